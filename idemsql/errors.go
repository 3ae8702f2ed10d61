package idemsql

import (
	"errors"

	"github.com/jackc/pgx/v5/pgconn"
)

// driverError puts the server's error that a database/sql driver
// returned into the form idem translates: a *pgconn.PgError. pgx's stdlib
// driver returns one already; another driver's error (lib/pq's *pq.Error)
// is recognised by its SQLState method, so that idem needs no import of
// the driver, and a *pgconn.PgError with its SQLSTATE joins it in the
// chain: errors.As still finds the driver's own error.
func driverError(err error) error {
	if err == nil {
		return nil
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return err
	}
	var coded interface{ SQLState() string }
	if !errors.As(err, &coded) || coded.SQLState() == "" {
		return err
	}
	return &serverError{pg: &pgconn.PgError{Severity: "ERROR", Code: coded.SQLState(), Message: err.Error()}, err: err}
}

// serverError is a driver's error from the server, with its SQLSTATE as a
// *pgconn.PgError beside it.
type serverError struct {
	pg  *pgconn.PgError
	err error
}

func (e *serverError) Error() string { return e.err.Error() }

func (e *serverError) Unwrap() []error { return []error{e.err, e.pg} }
