package webhooksig

import (
	"crypto/ed25519"
	"encoding/base64"
	"errors"
	"strings"
	"testing"
)

// The vectors that the Standard Webhooks reference libraries test
// themselves against, the same in each language: a v1 signature by a
// symmetric secret and a v1a signature by an ed25519 seed, over one id,
// timestamp and body. The v1 one is also what `openssl dgst -sha256 -mac
// HMAC` gives for the content and the secret's bytes.
const (
	vectorID        = "msg_p5jXN8AQM9LWM0D4loKWxJek"
	vectorTimestamp = 1614265330
	vectorBody      = `{"test": 2432232314}`

	vectorSymmetric = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
	vectorV1        = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="

	vectorSeed = "whsk_VEVTVFNJR05JTkdLRVlET05PVFVTRVRISVNGT1JBTlk="
	vectorV1a  = "v1a,tQ9V2XOqn7jL/DQenEFpqIugdBVtiMmER5mhSkXBNwM0mkATuDe6KYYUuxqtaiHeYGb7KaaBRdM5WqyeFiL8Ag=="
)

func mustKeys(t *testing.T, secrets ...string) Keys {
	t.Helper()
	k, err := ParseKeys(secrets)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

func TestSignMatchesTheSpecificationsVectors(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ secret, want string }{
		{vectorSymmetric, vectorV1},
		// Without its prefix a secret is symmetric, as in the reference
		// libraries.
		{strings.TrimPrefix(vectorSymmetric, "whsec_"), vectorV1},
		{vectorSeed, vectorV1a},
	} {
		if got := mustKeys(t, c.secret).Sign(vectorID, vectorTimestamp, []byte(vectorBody)); got != c.want {
			t.Errorf("Sign with %s = %s, want %s", c.secret, got, c.want)
		}
	}
}

func TestVerifyAcceptsTheSpecificationsVectors(t *testing.T) {
	t.Parallel()
	public := "whpk_" + base64.StdEncoding.EncodeToString(mustKeys(t, vectorSeed).public[0])
	for _, c := range []struct{ secret, header string }{
		{vectorSymmetric, vectorV1},
		{vectorSeed, vectorV1a},
		{public, vectorV1a},
		// Several signatures, some of versions or keys not ours: one
		// match is enough.
		{public, "v1,Ceo5qEr07ixe2NLpvHk3FH9bwy/WavXrAFQ/9tdO6mc= v2,Ceo5qEr07ixe2NLpvHk3FH9bwy/WavXrAFQ/9tdO6mc= " + vectorV1a},
		{vectorSymmetric, vectorV1a + "  " + vectorV1},
	} {
		if err := mustKeys(t, c.secret).Verify(vectorID, vectorTimestamp, []byte(vectorBody), c.header); err != nil {
			t.Errorf("Verify with %s of %q: %v", c.secret, c.header, err)
		}
	}
}

func TestVerifyRefusesWhatTheKeysDidNotSign(t *testing.T) {
	t.Parallel()
	k := mustKeys(t, vectorSymmetric, vectorSeed)
	body := []byte(vectorBody)
	for _, c := range []struct {
		name   string
		id     string
		ts     int64
		body   []byte
		header string
		want   error
	}{
		{"another body", vectorID, vectorTimestamp, []byte(`{"test": 2432232315}`), vectorV1 + " " + vectorV1a, ErrNoMatch},
		{"another id", vectorID + "x", vectorTimestamp, body, vectorV1 + " " + vectorV1a, ErrNoMatch},
		{"another timestamp", vectorID, vectorTimestamp + 1, body, vectorV1 + " " + vectorV1a, ErrNoMatch},
		{"a v1 signature under v1a", vectorID, vectorTimestamp, body, "v1a," + strings.TrimPrefix(vectorV1, "v1,"), ErrNoMatch},
		{"a v1a signature under v1", vectorID, vectorTimestamp, body, "v1," + strings.TrimPrefix(vectorV1a, "v1a,"), ErrNoMatch},
		{"a truncated signature", vectorID, vectorTimestamp, body, vectorV1[:19], ErrNoMatch},
		{"unknown versions only", vectorID, vectorTimestamp, body, "v2," + strings.TrimPrefix(vectorV1, "v1,"), ErrNoMatch},
		{"empty", vectorID, vectorTimestamp, body, "", ErrMalformed},
		{"no comma", vectorID, vectorTimestamp, body, strings.ReplaceAll(vectorV1, ",", ""), ErrMalformed},
		{"not base64", vectorID, vectorTimestamp, body, "v1,@@@@", ErrMalformed},
		{"an empty signature", vectorID, vectorTimestamp, body, "v1,", ErrMalformed},
	} {
		if err := k.Verify(c.id, c.ts, c.body, c.header); !errors.Is(err, c.want) {
			t.Errorf("%s: Verify = %v, want %v", c.name, err, c.want)
		}
	}
}

func TestRotationSignsWithEverySecretAndVerifiesWithAny(t *testing.T) {
	t.Parallel()
	old, next := "whsec_"+base64.StdEncoding.EncodeToString([]byte("the old secret, 24 bytes")), vectorSymmetric
	both := mustKeys(t, old, next, vectorSeed)
	header := both.Sign(vectorID, vectorTimestamp, []byte(vectorBody))
	if n := len(strings.Fields(header)); n != 3 {
		t.Fatalf("signed with 3 secrets, got %d signatures: %s", n, header)
	}
	// A receiver that holds any one of them, or only the public key,
	// accepts the delivery.
	public := "whpk_" + base64.StdEncoding.EncodeToString(both.public[0])
	for _, secret := range []string{old, next, public} {
		if err := mustKeys(t, secret).Verify(vectorID, vectorTimestamp, []byte(vectorBody), header); err != nil {
			t.Errorf("receiver with %s only: %v", secret, err)
		}
	}
	// One that holds none refuses it.
	other := "whsec_" + base64.StdEncoding.EncodeToString([]byte("another secret, 24 bytes"))
	if err := mustKeys(t, other).Verify(vectorID, vectorTimestamp, []byte(vectorBody), header); !errors.Is(err, ErrNoMatch) {
		t.Errorf("receiver with another secret: %v, want ErrNoMatch", err)
	}
}

func TestParseKeysRefusesWhatCannotWork(t *testing.T) {
	t.Parallel()
	seed := mustKeys(t, vectorSeed).private[0]
	notItsPublic := append(append([]byte(nil), seed.Seed()...), make([]byte, ed25519.PublicKeySize)...)
	for _, secrets := range [][]string{
		nil,
		{""},
		{"whsec_"},
		{"whsec_not base64!"},
		{"whsk_" + base64.StdEncoding.EncodeToString([]byte("short"))},
		{"whsk_" + base64.StdEncoding.EncodeToString(notItsPublic)},
		{"whpk_" + base64.StdEncoding.EncodeToString(make([]byte, 31))},
		{vectorSymmetric, "whpk_%%%"},
	} {
		_, err := ParseKeys(secrets)
		if err == nil {
			t.Errorf("ParseKeys(%q) = nil, want an error", secrets)
			continue
		}
		for _, s := range secrets {
			if len(s) > 6 && strings.Contains(err.Error(), s[6:]) {
				t.Errorf("ParseKeys(%q) = %v: the error must not hold the secret", secrets, err)
			}
		}
	}
	// A Go private key, the seed followed by its public key, is a seed.
	full := mustKeys(t, "whsk_"+base64.StdEncoding.EncodeToString(seed))
	if got := full.Sign(vectorID, vectorTimestamp, []byte(vectorBody)); got != vectorV1a {
		t.Errorf("whsk_ of 64 bytes signs %s, want %s", got, vectorV1a)
	}
	if mustKeys(t, "whpk_"+base64.StdEncoding.EncodeToString(seed.Public().(ed25519.PublicKey))).CanSign() {
		t.Error("a public key alone can sign")
	}
}
