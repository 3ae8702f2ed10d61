// Payments is a complete example service built on idem, for a team to copy:
//
//   - its own goose migrations beside idem's, each set with its own version
//     table (migrate.go);
//   - sqlc queries, generated into internal/db from sqlc.yaml, which reads
//     idem's tables from idem's schema.sql and the service's from its
//     migrations (docs/sqlc.md);
//   - POST /payments behind idemhttp: a retried request, with the same
//     Idempotency-Key, gets the first answer again (payments.go);
//   - a repository that calls idem.Do keyed by the order, in the request's
//     transaction, so that an order is paid once even when two requests
//     with different keys ask for it, and that enqueues the payment's
//     webhook with outbox.Enqueue in the same transaction;
//   - an outbox relay that delivers each webhook, with the message's
//     idempotency key in its Idempotency-Key header, and a receiver that
//     applies each once with idem.Once on that key (webhook.go).
//
// Run it against a database of its own:
//
//	DATABASE_URL=postgres://localhost/payments go run ./examples/payments
//
//	curl -i -X POST localhost:8080/payments \
//		-H 'Authorization: Bearer merchant-1' \
//		-H 'Idempotency-Key: 5f0c3e0e-8d1b-4a57-9b1e-2f1a4c7d9e21' \
//		-d '{"order_id": "order-1", "amount_cents": 1200, "currency": "EUR"}'
//
// Send the same request again: the same answer, with Idempotent-Replayed:
// true. The receiver listens on RECEIVER_ADDR (default 127.0.0.1:8081) and
// the relay posts to WEBHOOK_URL (default: that receiver); ADDR (default
// 127.0.0.1:8080) is the API's. The bearer token stands for real
// authentication: it is the merchant.
//
// payments_test.go runs the whole service on a database from idemtest,
// through proxies that drop answers after the server gave them, and checks
// that every payment is recorded once and reaches the receiver once.
package main
