package main

import (
	"cmp"
	"context"
	"errors"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/idem/outbox"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := runFromEnv(ctx); err != nil {
		slog.Error("payments", "error", err)
		os.Exit(1)
	}
}

// runFromEnv runs the service as the package documentation says, on the
// environment's settings.
func runFromEnv(ctx context.Context) error {
	var lc net.ListenConfig
	api, err := lc.Listen(ctx, "tcp", cmp.Or(os.Getenv("ADDR"), "127.0.0.1:8080"))
	if err != nil {
		return err
	}
	receiver, err := lc.Listen(ctx, "tcp", cmp.Or(os.Getenv("RECEIVER_ADDR"), "127.0.0.1:8081"))
	if err != nil {
		api.Close()
		return err
	}
	cfg := config{
		DatabaseURL: os.Getenv("DATABASE_URL"),
		WebhookURL:  cmp.Or(os.Getenv("WEBHOOK_URL"), "http://"+receiver.Addr().String()+"/webhooks/payments"),
	}
	return run(ctx, cfg, api, receiver)
}

// config is what the service needs besides its listeners.
type config struct {
	// DatabaseURL is the service's database, where run applies idem's
	// migrations and the service's own.
	DatabaseURL string
	// WebhookURL is where the relay posts each payment's webhook.
	WebhookURL string
	// Relay configures the relay; its Destinations are the service's.
	// The zero value is outbox's defaults.
	Relay outbox.Config
}

// run migrates the database, then serves the API on api and the webhook
// receiver on receiver and runs the relay, until ctx ends.
func run(ctx context.Context, cfg config, api, receiver net.Listener) error {
	pool, err := pgxpool.New(ctx, cfg.DatabaseURL)
	if err != nil {
		api.Close()
		receiver.Close()
		return err
	}
	defer pool.Close()
	if err := migrate(ctx, pool); err != nil {
		api.Close()
		receiver.Close()
		return err
	}
	relay, err := startWebhookRelay(ctx, pool, cfg.WebhookURL, cfg.Relay)
	if err != nil {
		api.Close()
		receiver.Close()
		return err
	}
	defer relay.Stop() // before the pool closes
	// The first of them to fail stops the other.
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	errs := make([]error, 2)
	for i, part := range []func() error{
		func() error { return serve(ctx, api, newAPI(pool)) },
		func() error { return serve(ctx, receiver, newReceiver(pool)) },
	} {
		wg.Go(func() {
			if errs[i] = part(); errs[i] != nil {
				cancel()
			}
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}

// serve serves h on l until ctx ends, then lets the requests in flight
// finish for a few seconds, and closes the connections still open after
// that: a client that keeps one open must not keep the service up.
func serve(ctx context.Context, l net.Listener, h http.Handler) error {
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
	errs := make(chan error, 1)
	go func() { errs <- srv.Serve(l) }()
	select {
	case err := <-errs:
		return err
	case <-ctx.Done():
	}
	shutdown, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	if err := srv.Shutdown(shutdown); errors.Is(err, context.DeadlineExceeded) {
		return srv.Close()
	} else if err != nil {
		return err
	}
	return nil
}
