-- idem's tables on Citus, distributed by scope (docs/large-deployments.md).
--
-- Run this on the coordinator, in the application's database, once idem's
-- migrations have created the tables (idem.Migrate or "idem migrate up"
-- pointed at the coordinator) and before the tables hold many rows
-- (create_distributed_table copies what they hold into the shards). Later
-- migrations are applied through the coordinator too: Citus propagates
-- their ALTER TABLEs to the shards.
--
-- The application's tenant tables are distributed by their tenant column
-- with colocate_with => 'idempotency_key', so that a key's record and the
-- rows its transaction writes live on one shard and each Do or Run is a
-- single-shard transaction. Their tenant must be the scope idem is given
-- (idem.Scope), and their distribution column of type text, like scope.
--
-- Every statement idem runs on these tables names one scope, and Citus
-- routes it to one shard, but for the ones that read or delete across
-- scopes (purge, stats, a completer's search for abandoned flows), which
-- idem runs in forms Citus can distribute when the citus extension is
-- installed.

-- One record per client key, with its scope's business rows.
SELECT create_distributed_table('idempotency_key', 'scope');

-- Advance's versions, flows and their steps, on the same shards.
SELECT create_distributed_table('entity_version', 'scope', colocate_with => 'idempotency_key');
SELECT create_distributed_table('idem_flow', 'scope', colocate_with => 'idempotency_key');
SELECT create_distributed_table('idem_flow_step_row', 'scope', colocate_with => 'idempotency_key');

-- The installation's id, which every flow's start reads: copied to every
-- node, so that a statement on one shard can read it there.
SELECT create_reference_table('idem_installation');

-- outbox_message stays a table of the coordinator: a relay leases messages
-- across scopes with FOR UPDATE SKIP LOCKED, which Citus runs only on a
-- single shard. A transaction that writes a distributed table enqueues
-- into it all the same, but Citus commits the worker's part first, on its
-- own, then the coordinator's: not with two-phase commit. A failure
-- between the two (the coordinator's crash, a serialization failure at its
-- commit) keeps the business write and the key's record without the
-- message (docs/large-deployments.md).
-- goose_db_version, idem_flow_seq and idem_key_lock stay on the coordinator.
