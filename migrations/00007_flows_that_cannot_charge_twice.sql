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
-- Flows started under the Up section get operation numbers, and with them
-- other provider keys: settle or end running flows before going down.
UPDATE idem_flow_step SET state = 'calling' WHERE state = 'unsent';
ALTER TABLE idem_flow_step
    DROP COLUMN last_reconcile,
    DROP COLUMN reconciles,
    DROP CONSTRAINT idem_flow_step_state_check,
    ADD CONSTRAINT idem_flow_step_state_check CHECK (state IN ('calling', 'done'));
UPDATE idem_flow SET operation = nextval('idem_flow_seq') WHERE operation IS NULL;
ALTER TABLE idem_flow
    DROP CONSTRAINT idem_flow_provider_key_check,
    DROP COLUMN provider_namespace,
    ALTER COLUMN operation SET NOT NULL;
DROP TABLE idem_installation;
