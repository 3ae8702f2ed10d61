package adapter

import (
	"errors"
	"math"
	"testing"

	"github.com/pgidem/idem"
)

// TestResponseLimitHasOneBound checks the bound that idemhttp and idemgrpc
// share: every limit up to MaxMaxResponseBytes has a stored size that fits
// in an int without a codec, the next one is refused, and with a codec
// the largest limits are refused rather than overflow.
func TestResponseLimitHasOneBound(t *testing.T) {
	t.Parallel()
	limit, stored, err := responseLimit("p", "Config.MaxResponseBytes", MaxMaxResponseBytes, 1, false)
	if err != nil || limit != MaxMaxResponseBytes || stored <= limit || stored > math.MaxInt {
		t.Errorf("at the bound: %d, %d, %v", limit, stored, err)
	}
	for _, c := range []struct {
		n      int
		sealed bool
	}{{MaxMaxResponseBytes + 1, false}, {math.MaxInt, false}, {MaxMaxResponseBytes, true}, {math.MaxInt / 3 * 2, true}} {
		_, _, err := responseLimit("p", "Config.MaxResponseBytes", c.n, 1, c.sealed)
		if fe, ok := errors.AsType[*idem.FieldError](err); !ok || fe.Field != "Config.MaxResponseBytes" {
			t.Errorf("%d (sealed %t): got %v, want a FieldError", c.n, c.sealed, err)
		}
	}
	if limit, stored, err := responseLimit("p", "f", -1, 1, true); err != nil || limit != math.MaxInt || stored != math.MaxInt {
		t.Errorf("negative: %d, %d, %v; want no limit", limit, stored, err)
	}
	if limit, stored, err := responseLimit("p", "f", 0, 3, false); err != nil || limit != 3 || stored != 4+storedAllowance {
		t.Errorf("zero: %d, %d, %v; want the default, 3, stored in %d", limit, stored, err, 4+storedAllowance)
	}
}
