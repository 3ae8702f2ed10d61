-- +goose Up
-- One row per payment webhook the receiver applied. It stands for another
-- system's table: the receiver deduplicates the relay's retries with
-- idem.Once on the message's idempotency key, so nothing here forbids a
-- second row, and the tests count them.
CREATE TABLE ledger_entry (
    id           bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    payment_id   bigint      NOT NULL,
    merchant     text        NOT NULL,
    order_id     text        NOT NULL,
    amount_cents bigint      NOT NULL,
    currency     text        NOT NULL,
    received_at  timestamptz NOT NULL DEFAULT now()
);

-- +goose Down
DROP TABLE ledger_entry;
