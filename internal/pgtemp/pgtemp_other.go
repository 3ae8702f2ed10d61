//go:build !unix

package pgtemp

import (
	"context"
	"errors"
	"os"
)

// Server is a running throwaway server; see the Unix implementation.
type Server struct {
	URL, Version, BinDir, Dir, User string
	Port                            int
}

// Config configures Start; see the Unix implementation.
type Config struct {
	Fast           bool
	MaxConnections int
	Port           int
	StandbyOf      *Server
}

// Start fails: throwaway servers need a Unix system.
func Start(context.Context, Config) (*Server, error) {
	return nil, errors.New("pgtemp: throwaway servers need a Unix system")
}

// Stop does nothing.
func (s *Server) Stop() error { return nil }

// Restart fails: throwaway servers need a Unix system.
func (s *Server) Restart(context.Context) error {
	return errors.New("pgtemp: throwaway servers need a Unix system")
}

// Kill does nothing.
func (s *Server) Kill(os.Signal) error { return nil }
