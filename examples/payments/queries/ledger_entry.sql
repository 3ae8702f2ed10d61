-- name: LedgerEntryInsert :exec
-- LedgerEntryInsert applies a payment webhook. It runs inside idem.Once on
-- the webhook's idempotency key, which makes it once per payment.
INSERT INTO ledger_entry (payment_id, merchant, order_id, amount_cents, currency)
VALUES (@payment_id::bigint, @merchant::text, @order_id::text, @amount_cents::bigint, @currency::text);
