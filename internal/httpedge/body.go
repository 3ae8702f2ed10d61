package httpedge

import (
	"errors"
	"io"
	"math"
	"net/http"
)

// Errors of ReadBody.
var (
	ErrBodyTooLarge   = errors.New("body over the limit")
	ErrBodyUnreadable = errors.New("body unreadable")
)

// ReadBody reads r's whole body, up to limit bytes (math.MaxInt64 for no
// limit). A body announced larger (Content-Length) is refused before it is
// read, and one that turns out larger once the limit is passed, without
// reading the rest: ErrBodyTooLarge. A body that cannot be read (the
// connection broke) gives ErrBodyUnreadable. An empty body is an empty
// slice, never nil: pgx stores a nil slice as NULL.
func ReadBody(r *http.Request, limit int64) ([]byte, error) {
	if r.ContentLength > limit {
		return nil, ErrBodyTooLarge
	}
	if r.Body == nil || r.Body == http.NoBody {
		return []byte{}, nil
	}
	// One byte past the limit tells a body over it from one at it; at
	// math.MaxInt64 that byte would wrap the limit negative and read
	// nothing, and no body can be longer anyway.
	read := limit
	if read < math.MaxInt64 {
		read++
	}
	body, err := io.ReadAll(io.LimitReader(r.Body, read))
	var maxBytesErr *http.MaxBytesError
	switch {
	case errors.As(err, &maxBytesErr) || int64(len(body)) > limit:
		return nil, ErrBodyTooLarge
	case err != nil:
		return nil, ErrBodyUnreadable
	}
	return body, nil
}
