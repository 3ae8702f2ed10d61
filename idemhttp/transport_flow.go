package idemhttp

import (
	"errors"
	"fmt"
	"net/http"

	"github.com/pgidem/idem"
)

// This file holds what the Transport does for the calls of a flow: the
// call's provider key on its requests.

// ErrKeyConflict is in the chain of the error a [Transport] with
// [Transport.UseProviderKey] returns, before anything is sent, for a
// request made from a flow's call that already carries a key other than
// the call's provider key: sent, it would reach the provider under a key
// that the call's next attempt, after a crash, would not send again. The
// error wraps [idem.ErrInvalidKey] and [idem.ErrNotSent] too.
var ErrKeyConflict = errors.New("idemhttp: the request carries a key other than its flow call's provider key")

// providerKey returns the provider key of the flow's call that out is made
// from, when the Transport is to send it: UseProviderKey is set, out's
// context carries one, and out's method is not safe.
func (s *transportSettings) providerKey(out *http.Request) (string, bool) {
	if !s.useProviderKey || isSafe(out.Method) {
		return "", false
	}
	return idem.ProviderKeyFromContext(out.Context())
}

// inCall reports whether out is made from a flow's call: its context
// carries the call's provider key. Such a request that carries no key
// gets none of the Transport's own, and one attempt: a key of its own
// would differ on the call's next attempt, and a provider that ignores
// keys would apply each retry.
func inCall(out *http.Request) bool {
	_, ok := idem.ProviderKeyFromContext(out.Context())
	return ok
}

// setProviderKey sends providerKey, as it is, under the key's field of
// out, whose values are those the caller set: none, or the same key.
func (s *transportSettings) setProviderKey(out *http.Request, providerKey string, values []string) error {
	for _, v := range values {
		if callersKey(v) != providerKey {
			return fmt.Errorf("%w: its %s header field holds %q, and the call's provider key is %q: "+
				"leave the field to the Transport, or set it to the call's key (%w, %w)",
				ErrKeyConflict, s.header, v, providerKey, idem.ErrInvalidKey, idem.ErrNotSent)
		}
	}
	// Bare, as providers document their keys (Stripe, Adyen, Checkout.com,
	// PayPal) and idemhttp reads them too: a UUID needs no quoting.
	out.Header[s.header] = []string{providerKey}
	return nil
}
