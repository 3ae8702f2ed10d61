package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/outbox"
)

// runRelay builds a relay with config, shortens its background intervals
// (maintenance, probe wait, probe retry) when given, and runs it until the
// returned stop is called or the test ends.
func runRelay(t *testing.T, ctx context.Context, db idem.TxBeginner, handler outbox.Handler, config outbox.Config, intervals ...time.Duration) (stop func()) {
	t.Helper()
	if config.Logger == nil {
		config.Logger = testLogger(t)
	}
	listenDirectly(t, db, &config)
	relay, err := outbox.NewRelay(db, handler, &config)
	if err != nil {
		t.Fatal(err)
	}
	if len(intervals) == 3 {
		outbox.SetIntervals(relay, intervals[0], intervals[1], intervals[2])
	}
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- relay.Run(ctx) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			if err := <-done; err != nil {
				t.Errorf("Run: %v", err)
			}
		})
	}
	t.Cleanup(stop)
	return stop
}

// A relay given one connection must use it one statement at a time: it
// used to record outcomes from several goroutines at once on it ("conn
// busy", a data race), record none, and break the connection for good.
func TestRelayOnOneConnection(t *testing.T) {
	t.Parallel()
	for _, kind := range []string{"pgx.Conn", "pgxpool.Conn"} {
		t.Run(kind, func(t *testing.T) {
			ctx, pool, scope, dest := setup(t)
			var db idem.TxBeginner
			var ping func() error
			switch kind {
			case "pgx.Conn":
				conn, err := pgx.Connect(ctx, env.URL(t))
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { conn.Close(context.Background()) })
				db, ping = conn, func() error { return conn.Ping(ctx) }
			case "pgxpool.Conn":
				conn, err := pool.Acquire(ctx)
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(conn.Release)
				db, ping = conn, func() error { return conn.Ping(ctx) }
			}
			const messages = 40
			all := entries(scope, dest, messages)
			all = append(all, outbox.Entry{Scope: scope, Key: "in-flight-at-stop", Destination: dest})
			got := newCalls()
			inFlight := make(chan struct{})
			logger, logs := capturingLogger(t)
			stop := runRelay(t, ctx, db, func(ctx context.Context, msg outbox.Message) error {
				got.add(msg)
				if msg.Key == "in-flight-at-stop" {
					close(inFlight)
					<-ctx.Done()
					return ctx.Err()
				}
				return nil
			}, outbox.Config{Destinations: []string{dest}, PollInterval: 10 * time.Millisecond, Logger: logger})
			enqueue(t, ctx, pool, all[:messages]...)
			waitWithin(t, 30*time.Second, "every message recorded as delivered", func() bool {
				return countState(t, pool, dest, "delivered") == messages
			})
			enqueue(t, ctx, pool, all[messages])
			<-inFlight
			stop()

			for _, r := range rows(t, pool, dest) {
				if n := got.count(r.ID); n != 1 {
					t.Errorf("message %d handled %d times, want once", r.ID, n)
				}
				if r.ID == rows(t, pool, dest)[messages].ID {
					// Interrupted by the stop: released, not counted.
					if r.State != "pending" || r.Attempts != 0 || r.Leased {
						t.Errorf("message in flight at stop: %+v, want released", r)
					}
				}
			}
			if n := logs.count("level=ERROR"); n != 0 {
				t.Errorf("the relay logged %d errors", n)
			}
			if err := ping(); err != nil {
				t.Errorf("the relay's connection after Run: %v", err)
			}
		})
	}
}

// Purging a large delivered backlog must not hold up delivery: the relay
// used to purge to the end before it leased anything.
func TestPurgeDoesNotHoldUpDelivery(t *testing.T) {
	ctx, pool, scope, dest := setup(t)
	const backlog = 100_000
	_, err := pool.Exec(ctx, `
		INSERT INTO outbox_message (scope, key, destination, payload, idempotency_key, state, attempts, created_at, delivered_at)
		SELECT $1, 'old' || i, $2, '', $2 || ':old:' || i, 'delivered', 1, now() - interval '2 days', now() - interval '2 days'
		FROM generate_series(1, $3::int) AS i`, scope, dest, backlog)
	if err != nil {
		t.Fatal(err)
	}
	old := func() int {
		var n int
		err := pool.QueryRow(context.Background(), `SELECT count(*) FROM outbox_message
			WHERE destination = $1 AND state = 'delivered' AND delivered_at < now() - interval '1 day'`, dest).Scan(&n)
		if err != nil {
			t.Error(err)
		}
		return n
	}
	enqueue(t, ctx, pool, outbox.Entry{Scope: scope, Key: "new", Destination: dest})

	leftAtDelivery := make(chan int, 1)
	runRelay(t, ctx, pool, func(ctx context.Context, msg outbox.Message) error {
		select {
		case leftAtDelivery <- old():
		default:
		}
		return nil
	}, outbox.Config{Destinations: []string{dest}, PollInterval: 10 * time.Millisecond})

	select {
	case left := <-leftAtDelivery:
		if left == 0 {
			t.Errorf("the message was delivered only once all %d delivered messages were purged", backlog)
		}
		t.Logf("delivered with %d of %d purgeable messages still to purge", left, backlog)
	case <-time.After(time.Minute):
		t.Fatal("the message was not delivered")
	}
	waitFor(t, "the backlog purged", func() bool { return old() == 0 })
	if n := countState(t, pool, dest, "delivered"); n != 1 {
		t.Errorf("%d delivered messages left, want the new one", n)
	}
}

// A relay with an Observer records, through the same providers as idem's
// calls, a span per delivery in the trace of the enqueuing request, counts
// by outcome, latency, backlog, and whether it hears notifications.
func TestRelayObservesDeliveries(t *testing.T) {
	ctx, pool, scope, dest := setup(t)
	tp, mp := &tracerProvider{}, newMeterProvider()
	observer, err := idem.NewObserver(idem.ObserverConfig{TracerProvider: tp, MeterProvider: mp})
	if err != nil {
		t.Fatal(err)
	}
	requestCtx, request := tp.Tracer("test").Start(ctx, "request")
	err = idem.WithTx(requestCtx, pool, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
		_, err := outbox.EnqueueMany(ctx, tx, []outbox.Entry{
			{Scope: scope, Key: "ok", Destination: dest},
			{Scope: scope, Key: "flaky", Destination: dest},
			{Scope: scope, Key: "rejected", Destination: dest},
		})
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	request.End()

	var mu sync.Mutex
	handlerSpans := map[trace.SpanID]string{}
	var flaky atomic.Int32
	runRelay(t, ctx, pool, func(ctx context.Context, msg outbox.Message) error {
		mu.Lock()
		handlerSpans[trace.SpanContextFromContext(ctx).SpanID()] = msg.Key
		mu.Unlock()
		switch msg.Key {
		case "flaky":
			if flaky.Add(1) == 1 {
				return errors.New("unavailable")
			}
		case "rejected":
			return outbox.Park(errors.New("invalid"))
		}
		return nil
	}, outbox.Config{
		Destinations: []string{dest}, PollInterval: 10 * time.Millisecond,
		RetryDelay: 10 * time.Millisecond, MaxRetryDelay: 20 * time.Millisecond, Observer: observer,
	}, 20*time.Millisecond, 5*time.Second, time.Minute)

	destAttr := attribute.String("idem.outbox.destination", dest)
	state := func(s string) attribute.KeyValue { return attribute.String("idem.outbox.state", s) }
	notifications := func(s string) attribute.KeyValue { return attribute.String("idem.outbox.notifications", s) }
	outcome := func(s string) attribute.KeyValue { return attribute.String("idem.outbox.outcome", s) }
	waitFor(t, "the backlog counted after every outcome", func() bool {
		pending, ok1 := mp.meter.gauge("idem.outbox.backlog", destAttr, state("pending"))
		parked, ok2 := mp.meter.gauge("idem.outbox.backlog", destAttr, state("parked"))
		return ok1 && ok2 && pending == 0 && parked == 1 && countState(t, pool, dest, "delivered") == 2
	})
	waitFor(t, "the relay listening", func() bool {
		return mp.meter.sum("idem.outbox.relays", notifications("listening")) == 1
	})
	if n := mp.meter.sum("idem.outbox.relays", notifications("polling")); n != 0 {
		t.Errorf("idem.outbox.relays{polling} = %d, want 0", n)
	}

	for name, want := range map[string]int64{"delivered": 2, "retried": 1, "parked": 1, "released": 0} {
		if got := mp.meter.sum("idem.outbox.deliveries", outcome(name), destAttr); got != want {
			t.Errorf("idem.outbox.deliveries{%s} = %d, want %d", name, got, want)
		}
	}
	latencies := mp.meter.recorded("idem.outbox.delivery.latency", destAttr)
	if len(latencies) != 2 {
		t.Errorf("%d latencies recorded, want 2", len(latencies))
	}
	for _, l := range latencies {
		if l <= 0 || l > 60 {
			t.Errorf("latency %gs, want between 0 and a minute", l)
		}
	}

	spans := tp.named("idem.outbox.deliver")
	if len(spans) != 4 {
		t.Fatalf("%d delivery spans, want one per attempt: 4", len(spans))
	}
	outcomes := map[string]int{}
	for _, s := range spans {
		if s.parent.TraceID() != request.SpanContext().TraceID() || s.parent.SpanID() != request.SpanContext().SpanID() || !s.parent.IsRemote() {
			t.Errorf("delivery span's parent %v, want the enqueuing request's span %v, remote", s.parent, request.SpanContext())
		}
		if s.kind != trace.SpanKindConsumer || !s.ended {
			t.Errorf("delivery span: kind %v, ended %t; want a consumer span, ended", s.kind, s.ended)
		}
		o := s.attr("idem.outbox.outcome").AsString()
		outcomes[o]++
		if (o == "delivered") != (s.status != codes.Error) {
			t.Errorf("delivery span with outcome %s has status %v", o, s.status)
		}
		mu.Lock()
		key, ok := handlerSpans[s.sc.SpanID()]
		mu.Unlock()
		if !ok || s.attr("idem.outbox.destination").AsString() != dest {
			t.Errorf("delivery span %v is not the handler's context's span (key %q)", s.sc.SpanID(), key)
		}
	}
	if fmt.Sprint(outcomes) != fmt.Sprint(map[string]int{"delivered": 2, "parked": 1, "retried": 1}) {
		t.Errorf("delivery span outcomes %v, want 2 delivered, 1 retried, 1 parked", outcomes)
	}
}

// The trace context of the enqueuing transaction reaches the handler's
// context even without an Observer, so that the handler's own
// instrumentation (an HTTP client's) joins the request's trace.
func TestTraceContextReachesHandler(t *testing.T) {
	ctx, pool, scope, dest := setup(t)
	tp := &tracerProvider{}
	requestCtx, request := tp.Tracer("test").Start(ctx, "request")
	enqueue(t, requestCtx, pool, outbox.Entry{Scope: scope, Key: "traced", Destination: dest})
	enqueue(t, ctx, pool, outbox.Entry{Scope: scope, Key: "untraced", Destination: dest})

	got := make(chan trace.SpanContext, 2)
	keys := make(chan string, 2)
	runRelay(t, ctx, pool, func(ctx context.Context, msg outbox.Message) error {
		got <- trace.SpanContextFromContext(ctx)
		keys <- msg.Key
		return nil
	}, outbox.Config{Destinations: []string{dest}, PollInterval: 10 * time.Millisecond})
	for range 2 {
		sc, key := <-got, <-keys
		switch key {
		case "traced":
			if !sc.Equal(request.SpanContext().WithRemote(true)) {
				t.Errorf("handler's span context %v, want the request's %v", sc, request.SpanContext())
			}
		case "untraced":
			if sc.IsValid() {
				t.Errorf("handler's span context %v for a message enqueued without a trace", sc)
			}
		}
	}
}

// A handler that needs longer than its lease extends it: it is delivered
// once, although another relay polls all the while, and its context does
// not end.
func TestExtendLeaseKeepsASlowDeliveryOnce(t *testing.T) {
	ctx, pool, scope, dest := setup(t)
	ids := enqueue(t, ctx, pool, outbox.Entry{Scope: scope, Key: "slow", Destination: dest})
	const lease = time.Second
	got := newCalls()
	handlerErr := make(chan error, 1)
	slow := func(ctx context.Context, msg outbox.Message) error {
		if got.add(msg) > 1 {
			return nil // delivered twice: counted, and the test fails
		}
		first, _ := ctx.Deadline()
		end := time.Now().Add(3 * lease)
		for time.Now().Before(end) {
			if err := outbox.ExtendLease(ctx, lease); err != nil {
				handlerErr <- err
				return err
			}
			time.Sleep(lease / 5)
		}
		if last, _ := ctx.Deadline(); !last.After(first) {
			handlerErr <- fmt.Errorf("deadline %v, not after the first %v", last, first)
			return nil
		}
		handlerErr <- ctx.Err()
		return ctx.Err()
	}
	runRelay(t, ctx, pool, slow, outbox.Config{Destinations: []string{dest}, LeaseDuration: lease, PollInterval: 10 * time.Millisecond})
	runRelay(t, ctx, pool, slow, outbox.Config{Destinations: []string{dest}, LeaseDuration: lease, PollInterval: 2 * time.Millisecond})

	if err := <-handlerErr; err != nil {
		t.Fatalf("slow handler: %v", err)
	}
	waitFor(t, "the slow message delivered", func() bool { return countState(t, pool, dest, "delivered") == 1 })
	if n := got.count(ids[0]); n != 1 {
		t.Errorf("handled %d times, want once", n)
	}
	if r := rows(t, pool, dest)[0]; r.Attempts != 1 {
		t.Errorf("%d attempts, want 1", r.Attempts)
	}
}

func TestExtendLeaseErrors(t *testing.T) {
	ctx, pool, scope, dest := setup(t)
	if err := outbox.ExtendLease(ctx, time.Minute); !errors.Is(err, idem.ErrInvalidOption) {
		t.Errorf("ExtendLease outside a handler: %v, want ErrInvalidOption", err)
	}
	enqueue(t, ctx, pool, outbox.Entry{Scope: scope, Key: "lost", Destination: dest})
	errs := make(chan error, 2)
	runRelay(t, ctx, pool, func(ctx context.Context, msg outbox.Message) error {
		errs <- outbox.ExtendLease(ctx, 0)
		// Another relay leases the message, as if this lease had run out.
		if _, err := pool.Exec(ctx, `UPDATE outbox_message SET attempts = attempts + 1 WHERE id = $1`, msg.ID); err != nil {
			return err
		}
		errs <- outbox.ExtendLease(ctx, time.Minute)
		return nil
	}, outbox.Config{Destinations: []string{dest}, PollInterval: 10 * time.Millisecond})
	if err := <-errs; !errors.Is(err, idem.ErrInvalidOption) {
		t.Errorf("ExtendLease by 0: %v, want ErrInvalidOption", err)
	}
	if err := <-errs; !errors.Is(err, outbox.ErrLeaseLost) {
		t.Errorf("ExtendLease of a lease another relay took: %v, want ErrLeaseLost", err)
	}
}

// EnqueueMany sends its entries in one statement and does what as many
// Enqueue calls would.
func TestEnqueueMany(t *testing.T) {
	ctx, _, scope, dest := setup(t)
	config, err := pgxpool.ParseConfig(env.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	var statements atomic.Int64
	config.ConnConfig.Tracer = countingTracer{&statements}
	pool, err := pgxpool.NewWithConfig(ctx, config)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)

	all := entries(scope, dest, 500)
	existing := enqueue(t, ctx, pool, all[7])
	many := func(batch []outbox.Entry) (ids []int64, sent int64, err error) {
		err = idem.WithTx(ctx, pool, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) error {
			before := statements.Load()
			var err error
			ids, err = outbox.EnqueueMany(ctx, tx, batch)
			sent = statements.Load() - before
			return err
		})
		return ids, sent, err
	}

	ids, sent, err := many(all[8:])
	if err != nil {
		t.Fatal(err)
	}
	if sent != 1 {
		t.Errorf("EnqueueMany of %d new entries sent %d statements, want 1", len(all[8:]), sent)
	}
	byKey := map[string]int64{}
	for i, id := range ids {
		byKey[all[8+i].Key] = id
	}
	// Again, with new entries, an already enqueued one and a repeat within
	// the call: the same ids, nothing added twice.
	batch := append([]outbox.Entry{all[7], all[100]}, all[:7]...)
	batch = append(batch, all[100])
	ids2, _, err := many(batch)
	if err != nil {
		t.Fatal(err)
	}
	if ids2[0] != existing[0] || ids2[1] != byKey[all[100].Key] || ids2[len(ids2)-1] != ids2[1] {
		t.Errorf("EnqueueMany again: ids %v, want %d and %d for the enqueued entries", ids2, existing[0], byKey[all[100].Key])
	}
	got := rows(t, pool, dest)
	if len(got) != len(all) {
		t.Fatalf("%d messages, want %d", len(got), len(all))
	}
	for _, r := range got {
		if r.IdempotencyKey == "" || r.State != "pending" {
			t.Errorf("message %+v", r)
		}
	}
	for i, id := range ids {
		var key string
		if err := pool.QueryRow(ctx, `SELECT key FROM outbox_message WHERE id = $1`, id).Scan(&key); err != nil || key != all[8+i].Key {
			t.Errorf("id %d of entry %d has key %q (%v), want %q", id, 8+i, key, err, all[8+i].Key)
		}
	}

	changed := all[3]
	changed.Payload = []byte("another payload")
	if _, _, err := many([]outbox.Entry{all[400], changed}); !errors.Is(err, outbox.ErrEntryMismatch) {
		t.Errorf("EnqueueMany with a changed payload: %v, want ErrEntryMismatch", err)
	}
	if _, _, err := many([]outbox.Entry{{Scope: scope, Key: "x", Destination: dest, Payload: []byte("a")}, {Scope: scope, Key: "x", Destination: dest, Payload: []byte("b")}}); !errors.Is(err, outbox.ErrEntryMismatch) {
		t.Errorf("EnqueueMany with one key twice, two payloads: %v, want ErrEntryMismatch", err)
	}
	before := statements.Load()
	if _, err := outbox.EnqueueMany(ctx, panicTx{}, []outbox.Entry{all[0], {Scope: scope, Key: "", Destination: dest}}); !errors.Is(err, outbox.ErrInvalidEntry) {
		t.Errorf("EnqueueMany with an invalid entry: %v, want ErrInvalidEntry", err)
	}
	if ids, err := outbox.EnqueueMany(ctx, panicTx{}, nil); ids != nil || err != nil || statements.Load() != before {
		t.Errorf("EnqueueMany of nothing: %v, %v", ids, err)
	}
}

// countingTracer counts the statements a pool's connections send.
type countingTracer struct{ n *atomic.Int64 }

func (c countingTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	c.n.Add(1)
	return ctx
}

func (countingTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}
