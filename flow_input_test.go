package idem_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/internal/testdb"
)

// sealFails is a codec whose key service is down.
type sealFails struct{}

func (sealFails) Seal(string, []byte) ([]byte, error) {
	return nil, errors.New("key service unavailable")
}
func (sealFails) Open(string, []byte) ([]byte, error) {
	return nil, errors.New("key service unavailable")
}

// TestFlowInputThatCannotBeStoredIsErrInputNotStorable runs a flow with
// inputs it can never store: the error says so, with the reason beside it,
// and nothing runs or is recorded. A codec that fails to seal a fine input
// is not the input's fault, and its error does not say it is.
func TestFlowInputThatCannotBeStoredIsErrInputNotStorable(t *testing.T) {
	ctx, pool, scope, _ := setupFlow(t)
	var runs atomic.Int64
	fn := func(ctx context.Context, s *idem.Steps, in string) (string, error) { runs.Add(1); return in, nil }
	flow := idem.MustNewFlow(testdb.Name("input"), fn, idem.WithMaxResponseSize(64))
	for name, c := range map[string]struct {
		in  string
		why error
	}{
		"a NUL character": {"a\x00b", idem.ErrResponseNotStorable},
		"over the limit":  {strings.Repeat("x", 100), idem.ErrResponseTooLarge},
	} {
		_, err := flow.Run(ctx, pool, scope, testdb.Name("k"), nil, c.in)
		if !errors.Is(err, idem.ErrInputNotStorable) || !errors.Is(err, c.why) {
			t.Errorf("%s: got %v, want ErrInputNotStorable and %v", name, err, c.why)
		}
	}

	sealed := idem.MustNewFlow(testdb.Name("sealed"), fn, idem.WithCodec(sealFails{}))
	_, err := sealed.Run(ctx, pool, scope, testdb.Name("k"), nil, "ab")
	if !errors.Is(err, idem.ErrResponseNotStorable) || errors.Is(err, idem.ErrInputNotStorable) {
		t.Errorf("a codec that cannot seal: got %v, want ErrResponseNotStorable without ErrInputNotStorable", err)
	}

	var flows int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM idem_flow WHERE scope = $1`, scope).Scan(&flows); err != nil {
		t.Fatal(err)
	}
	if runs.Load() != 0 || flows != 0 {
		t.Fatalf("the flow ran %d times and recorded %d operations; want neither", runs.Load(), flows)
	}
}
