// Package webhooksig signs and verifies Standard Webhooks deliveries, the
// one implementation that the outbox's webhook sender and the receiver in
// idemhttp/webhook share: the secrets' forms (whsec_, whsk_, whpk_), the
// content signed ({id}.{timestamp}.{body}), and the webhook-signature
// header's list of v1 (HMAC-SHA256) and v1a (ed25519) signatures. It uses
// the standard library only.
package webhooksig

import (
	"crypto/ed25519"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"errors"
	"fmt"
	"strconv"
	"strings"
)

// The headers of a Standard Webhooks delivery, as the specification names
// them.
const (
	HeaderID        = "webhook-id"
	HeaderTimestamp = "webhook-timestamp"
	HeaderSignature = "webhook-signature"
)

// The forms of secrets the specification defines: a symmetric secret, an
// ed25519 private key (its seed), and an ed25519 public key, each in
// standard base64 after its prefix.
const (
	prefixSymmetric = "whsec_"
	prefixPrivate   = "whsk_"
	prefixPublic    = "whpk_"
)

// The signature identifiers of the webhook-signature header.
const (
	versionSymmetric  = "v1"
	versionAsymmetric = "v1a"
)

// Errors of Verify.
var (
	// ErrMalformed: the header holds no signature that reads as
	// "version,base64".
	ErrMalformed = errors.New("no signature in the header reads as version,base64")
	// ErrNoMatch: no signature in the header is one that the keys make.
	ErrNoMatch = errors.New("no signature matches")
)

// Keys are parsed secrets: what signs and what verifies. The zero value
// holds none.
type Keys struct {
	symmetric [][]byte
	private   []ed25519.PrivateKey
	public    []ed25519.PublicKey
}

// ParseKeys parses secrets in the specification's forms: "whsec_" and
// base64 (a symmetric secret: signs and verifies v1), "whsk_" and the
// base64 of an ed25519 seed of 32 bytes, or of a private key of 64 (signs
// v1a, and verifies it with its public key), "whpk_" and the base64 of an
// ed25519 public key (verifies v1a). A secret without a prefix is taken as
// symmetric, as the reference libraries take it. An empty list, and a
// secret that does not parse, is an error that names its index, never its
// value.
func ParseKeys(secrets []string) (Keys, error) {
	if len(secrets) == 0 {
		return Keys{}, errors.New("no secrets")
	}
	var k Keys
	for i, s := range secrets {
		if err := k.add(s); err != nil {
			return Keys{}, fmt.Errorf("secret %d: %w", i, err)
		}
	}
	return k, nil
}

func (k *Keys) add(secret string) error {
	form, encoded := "whsec_", secret
	for _, p := range []string{prefixSymmetric, prefixPrivate, prefixPublic} {
		if rest, ok := strings.CutPrefix(secret, p); ok {
			form, encoded = p, rest
			break
		}
	}
	raw, err := base64.StdEncoding.DecodeString(encoded)
	if err != nil {
		return fmt.Errorf("%s secret is not standard base64", form)
	}
	switch form {
	case prefixSymmetric:
		if len(raw) == 0 {
			return errors.New("whsec_ secret is empty")
		}
		k.symmetric = append(k.symmetric, raw)
	case prefixPrivate:
		var key ed25519.PrivateKey
		switch len(raw) {
		case ed25519.SeedSize:
			key = ed25519.NewKeyFromSeed(raw)
		case ed25519.PrivateKeySize:
			// A seed followed by its public key, as Go holds them: the
			// public half must be the seed's.
			key = ed25519.NewKeyFromSeed(raw[:ed25519.SeedSize])
			if !hmac.Equal(key, raw) {
				return errors.New("whsk_ key of 64 bytes is not a seed followed by its public key")
			}
		default:
			return fmt.Errorf("whsk_ key is %d bytes, want an ed25519 seed of %d (or a private key of %d)", len(raw), ed25519.SeedSize, ed25519.PrivateKeySize)
		}
		k.private = append(k.private, key)
		k.public = append(k.public, key.Public().(ed25519.PublicKey))
	case prefixPublic:
		if len(raw) != ed25519.PublicKeySize {
			return fmt.Errorf("whpk_ key is %d bytes, want an ed25519 public key of %d", len(raw), ed25519.PublicKeySize)
		}
		k.public = append(k.public, ed25519.PublicKey(raw))
	}
	return nil
}

// CanSign reports whether the keys hold a secret that signs: a whsec_ or a
// whsk_.
func (k Keys) CanSign() bool { return len(k.symmetric) > 0 || len(k.private) > 0 }

// Content is what a signature covers: the id, the timestamp in decimal
// seconds, and the body, joined by full stops.
func Content(id string, timestamp int64, body []byte) []byte {
	ts := strconv.FormatInt(timestamp, 10)
	out := make([]byte, 0, len(id)+1+len(ts)+1+len(body))
	out = append(out, id...)
	out = append(out, '.')
	out = append(out, ts...)
	out = append(out, '.')
	return append(out, body...)
}

// Sign returns the webhook-signature header's value for a delivery of body
// under id at timestamp (Unix seconds): a v1 signature for each symmetric
// secret and a v1a for each private key, in the order they were given,
// separated by spaces. It is empty when the keys hold nothing that signs.
func (k Keys) Sign(id string, timestamp int64, body []byte) string {
	content := Content(id, timestamp, body)
	var sigs []string
	for _, secret := range k.symmetric {
		sigs = append(sigs, versionSymmetric+","+base64.StdEncoding.EncodeToString(MAC(secret, content)))
	}
	for _, key := range k.private {
		sigs = append(sigs, versionAsymmetric+","+base64.StdEncoding.EncodeToString(ed25519.Sign(key, content)))
	}
	return strings.Join(sigs, " ")
}

// Verify checks the webhook-signature header's value for a delivery of
// body under id at timestamp. It succeeds when any signature of the list
// is one that the keys make: a v1 that equals the HMAC of any symmetric
// secret (compared in constant time), or a v1a that any public key
// verifies. Signatures of other versions are passed over, as the
// specification asks. It returns ErrMalformed when no entry of the list
// reads as "version,base64", and ErrNoMatch when none matches.
func (k Keys) Verify(id string, timestamp int64, body []byte, header string) error {
	content := Content(id, timestamp, body)
	var macs [][]byte
	readable := false
	for _, entry := range strings.Fields(header) {
		version, encoded, ok := strings.Cut(entry, ",")
		if !ok {
			continue
		}
		sig, err := base64.StdEncoding.DecodeString(encoded)
		if err != nil || len(sig) == 0 {
			continue
		}
		readable = true
		switch version {
		case versionSymmetric:
			if macs == nil {
				for _, secret := range k.symmetric {
					macs = append(macs, MAC(secret, content))
				}
			}
			for _, m := range macs {
				if hmac.Equal(m, sig) {
					return nil
				}
			}
		case versionAsymmetric:
			for _, key := range k.public {
				if ed25519.Verify(key, content, sig) {
					return nil
				}
			}
		}
	}
	if !readable {
		return ErrMalformed
	}
	return ErrNoMatch
}

// MAC is the HMAC-SHA256 of content keyed with secret: a v1 signature's
// bytes, and those of Stripe's and GitHub's signatures.
func MAC(secret, content []byte) []byte {
	h := hmac.New(sha256.New, secret)
	h.Write(content)
	return h.Sum(nil)
}
