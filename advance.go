package idem

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem/internal/dbsqlc"
)

// Advance records, in the caller's transaction tx, that version of entity
// is being applied in scope, and reports applied == true, but only if
// version is newer than every version of that entity already applied there.
// The caller applies its update only when applied is true, in tx, so that
// the update and the recorded version commit together or not at all.
//
// It is the guard for messages that carry an entity id and a version or
// sequence number: a redelivered message (the same version again) and a
// reordered one (version 3 arriving after version 5) report applied ==
// false and change nothing. Scopes are separate namespaces, as in [Do]: one
// entity id may be used in many.
//
// Two transactions delivering the same version at once apply it once: under
// READ COMMITTED the second waits for the first (as long as the caller's
// lock_timeout allows; past it, [ErrInProgress]), and once the first
// commits, reports applied == false; if the first rolls back, the second
// applies. Under REPEATABLE READ or SERIALIZABLE, an entity whose version
// was recorded after tx's snapshot was taken gives [ErrSerialization]: retry
// the whole transaction, as [WithTx] does. Only the newest version wins:
// unlike [Once], Advance does not remember every version it saw, so it
// fits messages that carry the entity's whole new state, not increments.
//
// Versions are compared as numbers. Zero is a valid first version; negative
// versions give [ErrInvalidVersion], because they are not sequence numbers
// but sentinels such as -1 or unsigned counters that overflowed, which
// would otherwise be skipped silently forever. The entity must follow the
// rules for keys: an invalid scope gives [ErrInvalidScope] and an invalid
// entity [ErrInvalidKey], before anything is sent to the database.
//
// The record never expires: an entity keeps one row per scope.
func Advance(ctx context.Context, tx pgx.Tx, scope, entity string, version int64) (applied bool, err error) {
	if _, err := newKeyRef(scope, entity, nil); err != nil {
		return false, err
	}
	if version < 0 {
		return false, fmt.Errorf("%w: %d is negative", ErrInvalidVersion, version)
	}
	n, err := dbsqlc.New(tx).EntityAdvance(ctx, dbsqlc.EntityAdvanceParams{Scope: scope, Entity: entity, Version: version})
	if err != nil {
		return false, translate("idem: advance entity version", err)
	}
	return n == 1, nil
}
