-- +goose Up
-- One row per message to deliver outside the database. A message is pending
-- until a relay's handler succeeds (delivered) or gives up on it (parked).
-- A pending message is leased while leased_until is in the future, and due
-- once next_attempt_at has passed. attempts counts leases, so it also tells
-- a relay whether the lease it holds is still the newest one.
CREATE TABLE outbox_message (
    id              bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    scope           text        NOT NULL,
    key             text        NOT NULL,
    destination     text        NOT NULL,
    payload         bytea       NOT NULL,
    idempotency_key text        NOT NULL,
    ordering_key    text,
    state           text        NOT NULL DEFAULT 'pending',
    attempts        integer     NOT NULL DEFAULT 0,
    created_at      timestamptz NOT NULL DEFAULT now(),
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    leased_until    timestamptz,
    delivered_at    timestamptz,
    last_error      text,
    CONSTRAINT outbox_message_state_check CHECK (state IN ('pending', 'delivered', 'parked')),
    CONSTRAINT outbox_message_delivered_at_check CHECK ((state = 'delivered') = (delivered_at IS NOT NULL)),
    CONSTRAINT outbox_message_scope_check CHECK (octet_length(scope) BETWEEN 1 AND 255),
    CONSTRAINT outbox_message_key_check CHECK (octet_length(key) BETWEEN 1 AND 255),
    CONSTRAINT outbox_message_destination_check CHECK (octet_length(destination) BETWEEN 1 AND 255),
    CONSTRAINT outbox_message_ordering_key_check CHECK (octet_length(ordering_key) BETWEEN 1 AND 255)
);

-- One message per derived key: enqueuing the same message again finds it
-- here instead of sending the provider a second request.
CREATE UNIQUE INDEX outbox_message_idempotency_key_idx ON outbox_message (idempotency_key);

-- Leasing walks the due pending messages, soonest first.
CREATE INDEX outbox_message_due_idx ON outbox_message (next_attempt_at, id)
    WHERE state = 'pending';

-- Leasing an ordered message looks for an earlier pending one with the same
-- destination and ordering key.
CREATE INDEX outbox_message_ordering_idx ON outbox_message (destination, ordering_key, id)
    WHERE state = 'pending' AND ordering_key IS NOT NULL;

-- Purging walks delivered messages from the oldest delivery forward.
CREATE INDEX outbox_message_delivered_at_idx ON outbox_message (delivered_at)
    WHERE state = 'delivered';

-- +goose Down
DROP TABLE outbox_message;
