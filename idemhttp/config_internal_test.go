package idemhttp

import (
	"log/slog"
	"maps"
	"math"
	"net/http"
	"slices"
	"testing"

	"github.com/jackc/pgx/v5"
)

func TestZeroMeansTheDefault(t *testing.T) {
	t.Parallel()
	s, err := newSettings(Config{Scope: func(*http.Request) (string, error) { return "s", nil }})
	if err != nil {
		t.Fatal(err)
	}
	if got := slices.Sorted(maps.Keys(s.methods)); !slices.Equal(got, []string{"PATCH", "POST"}) {
		t.Errorf("methods %q, want POST and PATCH", got)
	}
	if s.header != DefaultHeader {
		t.Errorf("header %q, want %q", s.header, DefaultHeader)
	}
	if s.maxBodyBytes != DefaultMaxBodyBytes || s.maxResponseBytes != DefaultMaxResponseBytes {
		t.Errorf("limits %d and %d, want %d and %d", s.maxBodyBytes, s.maxResponseBytes, DefaultMaxBodyBytes, DefaultMaxResponseBytes)
	}
	// idem.DefaultWait, 5s, in whole seconds.
	if s.retryAfter != "5" {
		t.Errorf("Retry-After %q, want 5", s.retryAfter)
	}
	if got := slices.Sorted(maps.Keys(s.replayHeaders)); !slices.Equal(got, []string{"Content-Language", "Content-Type", "Etag", "Location"}) {
		t.Errorf("replay headers %q", got)
	}
	if !s.store(499) || s.store(500) {
		t.Error("the store policy is not StoreBelow500")
	}
	if s.problemTypeBase != DefaultProblemTypeBase {
		t.Errorf("problem type base %q", s.problemTypeBase)
	}
	if s.txOptions != (pgx.TxOptions{IsoLevel: pgx.ReadCommitted}) {
		t.Errorf("transaction options %+v, want READ COMMITTED", s.txOptions)
	}
	if s.logger != slog.Default() {
		t.Error("a nil Logger is not slog.Default()")
	}
}

func TestNegativeLimitsMeanNoLimit(t *testing.T) {
	t.Parallel()
	s, err := newSettings(Config{
		Scope:        func(*http.Request) (string, error) { return "s", nil },
		MaxBodyBytes: -1, MaxResponseBytes: -1,
	})
	if err != nil {
		t.Fatal(err)
	}
	if s.maxBodyBytes != math.MaxInt64 || s.maxResponseBytes != math.MaxInt {
		t.Errorf("limits %d and %d, want none", s.maxBodyBytes, s.maxResponseBytes)
	}
}
