-- name: PaymentInsert :one
-- PaymentInsert records a paid order. It runs inside idem.Do on the
-- order, which makes it once per order.
INSERT INTO payment (merchant, order_id, amount_cents, currency)
VALUES (@merchant::text, @order_id::text, @amount_cents::bigint, @currency::text)
RETURNING id, merchant, order_id, amount_cents, currency, created_at;
