-- +goose Up
-- One row per paid order: the service's own table, beside idem's. The
-- repository writes it inside idem.Do keyed by the order, so an order is
-- paid once however many requests ask for it.
CREATE TABLE payment (
    id           bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    merchant     text        NOT NULL,
    order_id     text        NOT NULL,
    amount_cents bigint      NOT NULL CHECK (amount_cents > 0),
    currency     text        NOT NULL CHECK (currency ~ '^[A-Z]{3}$'),
    created_at   timestamptz NOT NULL DEFAULT now()
);

-- +goose Down
DROP TABLE payment;
