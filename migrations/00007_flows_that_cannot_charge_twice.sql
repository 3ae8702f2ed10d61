-- +goose Up
-- Flows that cannot charge twice, whatever happens to their executors, their
-- database or the other system's answers.
--
-- idem_installation holds one random id per database, made with idem's
-- tables. A flow's calls derive their provider keys from it and from the
-- operation's scope, key and step, and nothing else (see idem_flow's
-- provider_namespace): so two databases that call one provider account
-- (staging and production, two services, a database created again) never
-- send one key for different operations, while a flow's row lost in an
-- asynchronous failover is started again, on the promoted standby, with
-- the very keys its lost first run sent. A database restored from
-- another's backup or dump shares that one's id: give it a new one
-- (UPDATE idem_installation SET id = gen_random_uuid()) before both call
-- the same provider account. Flows already running keep the id they
-- started with.
CREATE TABLE idem_installation (
    id         uuid        NOT NULL,
    singleton  boolean     PRIMARY KEY DEFAULT true,
    created_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT idem_installation_singleton_check CHECK (singleton)
);

INSERT INTO idem_installation (id) VALUES (gen_random_uuid());

-- A flow started from now on has provider_namespace, the installation's id
-- when it started, and no operation number: its provider keys are derived
-- from the namespace. A flow started before this migration keeps deriving
-- them from its operation number, as it did when its calls were first made.
-- Epochs are random from now on (idem_flow_seq stays for the flows of
-- older versions of idem that may still run during a deployment).
ALTER TABLE idem_flow
    ADD COLUMN provider_namespace uuid,
    ALTER COLUMN operation DROP NOT NULL,
    ADD CONSTRAINT idem_flow_provider_key_check CHECK ((provider_namespace IS NULL) <> (operation IS NULL));

-- A call's step is 'calling' while an attempt may have reached the other
-- system, 'unsent' when every attempt so far surely did not (the call's
-- function said so: a refused connection), and 'done' with its result.
-- reconciles counts the lookups made for a call found 'calling' (see
-- idem.Reconcile), last_reconcile says what the last one found.
ALTER TABLE idem_flow_step
    DROP CONSTRAINT idem_flow_step_state_check,
    ADD CONSTRAINT idem_flow_step_state_check CHECK (state IN ('calling', 'unsent', 'done')),
    ADD COLUMN reconciles integer NOT NULL DEFAULT 0,
    ADD COLUMN last_reconcile text;

-- +goose Down
-- The version before derives a call's provider key from the flow's
-- operation number, which a flow started under the Up section has none of:
-- each gets one here. That is harmless for a flow that is done or ended,
-- which never calls again, and for one that has recorded no call, whose
-- calls are yet to be made; but a running flow, or one stopped for
-- attention, that has recorded a call would make it again with another
-- key, and the provider would apply it twice. Going down refuses while
-- any such flow is left, naming them, and changes nothing: settle them
-- first (let them finish, or end them with idem flow-end), as
-- docs/migrations.md ("Going back") says. The tables are locked against
-- writes first, so that no call is recorded between the check and the
-- numbering.
LOCK TABLE idem_flow, idem_flow_step IN EXCLUSIVE MODE;
-- +goose StatementBegin
DO $$
DECLARE
    unsettled bigint;
    named text;
BEGIN
    SELECT count(*), string_agg(format('%s/%s (flow %s, %s)', scope, key, name, state), ', ' ORDER BY place)
           FILTER (WHERE place <= 10)
    INTO unsettled, named
    FROM (SELECT f.scope, f.key, f.name, f.state, row_number() OVER (ORDER BY f.created_at, f.scope, f.key) AS place
          FROM idem_flow AS f
          WHERE f.operation IS NULL
            AND f.state IN ('running', 'attention')
            AND EXISTS (SELECT FROM idem_flow_step AS s WHERE s.scope = f.scope AND s.key = f.key AND s.kind = 'call')) AS listed;
    IF unsettled > 0 THEN
        RAISE EXCEPTION USING
            ERRCODE = 'object_not_in_prerequisite_state',
            MESSAGE = format('idem: migration 00007 cannot go down: %s flow(s) running or stopped for attention have recorded a call, '
                             'which the version before would make again with another provider key: %s%s. '
                             'Let them finish, or end them (idem flow-end), then go down again (docs/migrations.md, "Going back")',
                             unsettled, named, CASE WHEN unsettled > 10 THEN format(' and %s more', unsettled - 10) ELSE '' END);
    END IF;
END
$$;
-- +goose StatementEnd
UPDATE idem_flow_step SET state = 'calling' WHERE state = 'unsent';
ALTER TABLE idem_flow_step
    DROP COLUMN last_reconcile,
    DROP COLUMN reconciles,
    DROP CONSTRAINT idem_flow_step_state_check,
    ADD CONSTRAINT idem_flow_step_state_check CHECK (state IN ('calling', 'done'));
ALTER TABLE idem_flow DROP CONSTRAINT idem_flow_provider_key_check;
UPDATE idem_flow SET operation = nextval('idem_flow_seq') WHERE operation IS NULL;
ALTER TABLE idem_flow
    DROP COLUMN provider_namespace,
    ALTER COLUMN operation SET NOT NULL;
DROP TABLE idem_installation;
