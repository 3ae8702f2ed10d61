package idem

import (
	"regexp"
	"testing"

	"github.com/jackc/pgx/v5/pgtype"
)

var uuidV8Pattern = regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-8[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$`)

func TestProviderKeysAreStableUUIDsApartPerInstallationScopeKeyAndStep(t *testing.T) {
	t.Parallel()
	ns := func(b byte) providerKeys {
		return providerKeys{namespace: pgtype.UUID{Bytes: [16]byte{b, 1, 2, 3}, Valid: true}}
	}
	a := ns(1).of("acme", "order-1", "charge")
	if !uuidV8Pattern.MatchString(a) {
		t.Fatalf("provider key %q is not a version 8 UUID", a)
	}
	if a != ns(1).of("acme", "order-1", "charge") {
		t.Fatal("the provider key is not stable")
	}
	for _, other := range []string{
		ns(2).of("acme", "order-1", "charge"),
		ns(1).of("acme", "order-1", "refund"),
		ns(1).of("acme", "order-2", "charge"),
		ns(1).of("acm", "eorder-1", "charge"),
		providerKeys{operation: pgtype.Int8{Int64: 7, Valid: true}}.of("acme", "order-1", "charge"),
	} {
		if other == a {
			t.Fatalf("provider keys collide: %q", a)
		}
	}
}

// A flow started before migration 00007 keeps the provider keys its calls
// were first made with: this is the key that version sent for operation 7.
func TestProviderKeysOfFlowsStartedBeforeTheInstallationIDAreUnchanged(t *testing.T) {
	t.Parallel()
	got := providerKeys{operation: pgtype.Int8{Int64: 7, Valid: true}}.of("acme", "order-1", "charge")
	if want := "79590390-e717-8df7-ae61-6605dc681715"; got != want {
		t.Fatalf("the provider key of a flow started before the installation id is %s, was %s", got, want)
	}
}
