package adapter

import (
	"errors"
	"fmt"
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

// TestClassifyFlowErrorTakesTheFunctionsErrorForTheFlowsOwn checks the
// order of ClassifyFlowError: each sentinel that Flow.Run returns is its
// failure, and an error of the flow's function, which Flow.Run returns
// with ErrFlowIncomplete, is incomplete, whichever sentinel it wraps.
func TestClassifyFlowErrorTakesTheFunctionsErrorForTheFlowsOwn(t *testing.T) {
	t.Parallel()
	tooLarge := fmt.Errorf("%w: %w", idem.ErrInputNotStorable, idem.ErrResponseTooLarge)
	fnFailed := errors.Join(idem.ErrFlowIncomplete, errors.New("provider timeout"))
	for err, want := range map[error]FlowFailure{
		idem.ErrFlowChanged:              FlowChanged,
		idem.ErrFlowStopped:              FlowStopped,
		idem.ErrInProgress:               FlowInProgress,
		idem.ErrLeaseLost:                FlowInProgress,
		idem.ErrFingerprintMismatch:      FlowKeyReused,
		idem.ErrInvalidKey:               FlowKeyInvalid,
		tooLarge:                         FlowInputNotStorable,
		idem.ErrResponseNotStorable:      FlowFailed,
		errors.New("connection refused"): FlowFailed,
		fnFailed:                         FlowIncomplete,
	} {
		if got := ClassifyFlowError(fmt.Errorf("idem: flow %q: %w", "pay", err)); got != want {
			t.Errorf("%v: %d, want %d", err, got, want)
		}
		if want == FlowIncomplete {
			continue
		}
		// An error with ErrFlowIncomplete in its chain is the function's
		// own, whatever else it wraps.
		fnErr := errors.Join(idem.ErrFlowIncomplete, fmt.Errorf("the provider's client: %w", err))
		if got := ClassifyFlowError(fnErr); got != FlowIncomplete {
			t.Errorf("the function's error wrapping %v: %d, want FlowIncomplete", err, got)
		}
	}
}
