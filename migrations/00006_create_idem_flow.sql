-- +goose Up
-- One row per flow (idem.Flow): an operation of named steps, some of which
-- call other systems, identified by (scope, key) like a key's record. A
-- flow is 'running' until its function returns a value ('done', replayed
-- to retries until expires_at), or it is stopped: 'attention' when a call
-- could not be repeated safely (past the provider's window), 'ended' when
-- an operator ended it.
--
-- One executor at a time runs a running flow: the one whose epoch is the
-- row's, while leased_until is in the future. Every write an executor
-- makes checks both and renews the lease, so an executor that stalled past
-- its lease, or whose flow another took over (a new epoch), commits
-- nothing. Epochs come from idem_flow_seq, so that none is ever given
-- twice, not even to the next operation of a key whose flow was purged.
-- So does operation, the number of the operation that the key's flow
-- runs, new each time the flow starts (and the same across takeovers):
-- its calls' provider keys are derived from it, so that a key used again
-- once its flow expired never sends a provider a key of the operation
-- before.
--
-- input is the flow's input as JSON, for a completer to resume the flow
-- with; retention is kept so that whoever completes the flow dates its
-- expiry as the caller that started it asked.
CREATE SEQUENCE idem_flow_seq;

CREATE TABLE idem_flow (
    scope        text        NOT NULL,
    key          text        NOT NULL,
    name         text        NOT NULL,
    fingerprint  bytea       NOT NULL,
    state        text        NOT NULL,
    input        jsonb       NOT NULL,
    output       jsonb,
    operation    bigint      NOT NULL,
    epoch        bigint      NOT NULL,
    leased_until timestamptz,
    step         text,
    runs         integer     NOT NULL,
    last_error   text,
    retention    interval    NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now(),
    completed_at timestamptz,
    expires_at   timestamptz,
    PRIMARY KEY (scope, key),
    CONSTRAINT idem_flow_state_check CHECK (state IN ('running', 'done', 'attention', 'ended')),
    -- A running flow always has a lease, and only a finished one expires.
    CONSTRAINT idem_flow_lease_check CHECK ((state = 'running') = (leased_until IS NOT NULL)),
    CONSTRAINT idem_flow_expiry_check CHECK ((state IN ('done', 'ended')) = (expires_at IS NOT NULL)),
    CONSTRAINT idem_flow_scope_check CHECK (octet_length(scope) BETWEEN 1 AND 255),
    CONSTRAINT idem_flow_key_check CHECK (octet_length(key) BETWEEN 1 AND 255),
    CONSTRAINT idem_flow_name_check CHECK (octet_length(name) BETWEEN 1 AND 255)
) WITH (fillfactor = 80);

-- A completer looks for one flow's running operations whose lease ran out.
-- The lease is not in the index, so that renewing it, which every step and
-- every third of a lease during a call does, is a HOT update: it writes no
-- index entry, and the page's free space (fillfactor) takes the new row.
CREATE INDEX idem_flow_running_idx ON idem_flow (name)
    WHERE state = 'running';

-- Purging walks finished flows from the oldest expiry forward.
CREATE INDEX idem_flow_expires_at_idx ON idem_flow (expires_at)
    WHERE expires_at IS NOT NULL;

-- One row per step of a flow, in the order the flow's function took them
-- (seq from 0). A local step is written once, 'done', in the transaction of
-- its own writes. A call is written 'calling' before the other system is
-- called, and 'done' with its result after: a call found 'calling' is
-- called again, with the same key, unless first_called_at is older than
-- the provider's window. Steps go with their flow: every statement that
-- writes one holds the flow's row, and the statements that delete flows
-- delete their steps. (No foreign key: its check would lock the flow's row
-- once more, in the WAL too, at every step.)
CREATE TABLE idem_flow_step (
    scope           text        NOT NULL,
    key             text        NOT NULL,
    seq             integer     NOT NULL,
    name            text        NOT NULL,
    kind            text        NOT NULL,
    state           text        NOT NULL,
    result          jsonb,
    attempts        integer     NOT NULL,
    last_error      text,
    first_called_at timestamptz,
    completed_at    timestamptz,
    PRIMARY KEY (scope, key, seq),
    CONSTRAINT idem_flow_step_kind_check CHECK (kind IN ('local', 'call')),
    CONSTRAINT idem_flow_step_state_check CHECK (state IN ('calling', 'done')),
    CONSTRAINT idem_flow_step_seq_check CHECK (seq >= 0),
    CONSTRAINT idem_flow_step_name_check CHECK (octet_length(name) BETWEEN 1 AND 255)
) WITH (fillfactor = 80);

-- +goose Down
DROP TABLE idem_flow_step;
DROP TABLE idem_flow;
DROP SEQUENCE idem_flow_seq;
