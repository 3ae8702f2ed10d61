package outbox

import (
	"context"
	crand "crypto/rand"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/idem/internal/backoff"
	"github.com/pgidem/idem/internal/dberr"
	"github.com/pgidem/idem/internal/dbsqlc"
)

// probeTimeout is how long a relay waits for its own notification to reach
// its listening connection before it concludes that notifications do not
// reach it; reprobeInterval is how long it then waits before it tries
// again.
const (
	probeTimeout    = 5 * time.Second
	reprobeInterval = time.Minute
)

// errNotHeard says that the relay's own notification did not reach its
// listening connection.
var errNotHeard = errors.New("notifications do not reach the relay's listening connection " +
	"(is it connected through a pooler in transaction mode, such as PgBouncer's pool_mode=transaction? " +
	"set Config.ListenConnConfig to a direct connection)")

// listen wakes the relay whenever a transaction that called Notify commits.
// While it cannot listen, the relay still polls, and hearing says so.
//
// It listens on a connection of its own rather than one of the pool's: a
// connection held for as long as the relay runs would starve a small pool
// (one of a single connection would deliver nothing), and would keep
// pgxpool.Pool.Close waiting until the relay stopped.
func (r *Relay) listen(ctx context.Context, hearing *hearing, wake chan<- struct{}) {
	for {
		err := r.listenOnce(ctx, hearing, wake)
		if ctx.Err() != nil {
			return
		}
		hearing.failed(ctx, err)
		wait := r.config.PollInterval
		if errors.Is(err, errNotHeard) {
			wait = r.reprobeEvery
		}
		if backoff.Sleep(ctx, wait) != nil {
			return
		}
	}
}

// listenOnce opens a connection, listens on it, checks that a
// notification sent the way Notify sends them reaches it, and then wakes
// the relay at each notification until the connection fails or ctx ends.
func (r *Relay) listenOnce(ctx context.Context, hearing *hearing, wake chan<- struct{}) error {
	conn, err := connect(ctx, r.listenConfig)
	if err != nil {
		return fmt.Errorf("outbox: connect to listen: %w", err)
	}
	defer func() {
		closeCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), recordTimeout)
		defer cancel()
		_ = conn.Close(closeCtx)
	}()
	if err := dbsqlc.New(conn).OutboxListen(ctx); err != nil {
		return dberr.Translate("outbox: listen", err)
	}

	// A pooler in transaction mode runs LISTEN on whichever server
	// connection it lends, and never passes a notification on: probe
	// through db, the way Notify's transactions reach the database.
	probe := "probe:" + crand.Text()
	err = r.do(ctx, func(ctx context.Context, q *dbsqlc.Queries) error {
		if err := q.OutboxNotifyProbe(ctx, probe); err != nil {
			return dberr.Translate("outbox: send a probe notification", err)
		}
		return nil
	})
	if err != nil {
		return err
	}
	probeCtx, cancel := context.WithTimeout(ctx, r.probeWait)
	defer cancel()
	for {
		n, err := conn.WaitForNotification(probeCtx)
		if err != nil {
			if ctx.Err() == nil && probeCtx.Err() != nil {
				return errNotHeard
			}
			return fmt.Errorf("outbox: wait for notification: %w", err)
		}
		if n.Payload == probe {
			break
		}
		signal(wake)
	}
	hearing.listening(ctx)
	// Messages committed before the subscription took effect were not
	// announced to it: look once.
	signal(wake)
	for {
		if _, err := conn.WaitForNotification(ctx); err != nil {
			return fmt.Errorf("outbox: wait for notification: %w", err)
		}
		signal(wake)
	}
}

// connect opens a connection with config, or a copy of it: ConnectConfig
// requires a config that it has not used before, and one that
// pgx.ParseConfig made, or it panics.
func connect(ctx context.Context, config *pgx.ConnConfig) (conn *pgx.Conn, err error) {
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("the connection config must come from pgx.ParseConfig: %v", p)
		}
	}()
	return pgx.ConnectConfig(ctx, config.Copy())
}

// hearing tracks whether a running relay hears notifications, and says so
// in its log and its metrics: once when it stops hearing them, and once
// when it hears them again.
type hearing struct {
	relay *Relay
	mu    sync.Mutex
	heard bool // the relay hears notifications
	told  bool // the relay logged that it does not
}

func (n *hearing) start(ctx context.Context) { n.relay.metrics.relayState(ctx, false, true) }

func (n *hearing) stop(ctx context.Context) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.relay.metrics.relayState(ctx, n.heard, false)
}

// listening notes that the relay hears notifications.
func (n *hearing) listening(ctx context.Context) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.heard {
		return
	}
	n.relay.metrics.relayState(ctx, false, false)
	n.relay.metrics.relayState(ctx, true, true)
	n.heard = true
	if n.told {
		n.relay.logger.InfoContext(ctx, "outbox: the relay hears notifications again")
		n.told = false
	}
}

// failed notes that the relay does not hear notifications, because of err.
func (n *hearing) failed(ctx context.Context, err error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.heard {
		n.relay.metrics.relayState(ctx, true, false)
		n.relay.metrics.relayState(ctx, false, true)
		n.heard = false
	}
	if !n.told {
		n.relay.logger.WarnContext(ctx, "outbox: the relay does not hear notifications; it polls meanwhile, and says so again once it hears them",
			"poll_interval", n.relay.config.PollInterval, "error", err)
		n.told = true
	}
}

// signal wakes the relay without blocking: one pending wake-up is enough.
func signal(wake chan<- struct{}) {
	select {
	case wake <- struct{}{}:
	default:
	}
}
