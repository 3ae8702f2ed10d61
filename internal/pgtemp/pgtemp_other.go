//go:build !unix

package pgtemp

import (
	"context"
	"errors"
)

// Server is a running throwaway server; see the Unix implementation.
type Server struct {
	URL, Version, BinDir, Dir, User string
	Port                            int
}

// Where describes where Find looks, for error messages.
const Where = "a Unix system's PostgreSQL installation"

// Find finds nothing: throwaway servers need a Unix system.
func Find() (string, error) { return "", errors.New("throwaway servers need a Unix system") }

// Options configures Start; see the Unix implementation.
type Options struct {
	Fast, DefaultMaxConnections bool
}

// Start fails: throwaway servers need a Unix system.
func Start(context.Context, Options) (*Server, error) {
	return nil, errors.New("throwaway servers need a Unix system")
}

// Stop does nothing.
func (s *Server) Stop() error { return nil }
