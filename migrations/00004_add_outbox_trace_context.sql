-- +goose Up
-- The W3C trace context (traceparent and tracestate) of the transaction that
-- enqueued a message, so that its delivery joins the trace of the request
-- that caused it. NULL when that transaction was not traced. Adding nullable
-- columns without a default rewrites nothing, and the checks, NOT VALID, do
-- not scan the rows that exist, whose new columns are all NULL.
ALTER TABLE outbox_message
    ADD COLUMN trace_parent text,
    ADD COLUMN trace_state  text,
    ADD CONSTRAINT outbox_message_trace_parent_check CHECK (octet_length(trace_parent) <= 55) NOT VALID,
    ADD CONSTRAINT outbox_message_trace_state_check CHECK (octet_length(trace_state) <= 512) NOT VALID;

-- +goose Down
ALTER TABLE outbox_message
    DROP COLUMN trace_state,
    DROP COLUMN trace_parent;
