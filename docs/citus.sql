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

-- The outbox, a Citus local table: its rows stay in one shard on the
-- coordinator, which must be in Citus's metadata (citus_set_coordinator_host,
-- as Citus's documentation has a cluster set up). A transaction through the
-- coordinator that writes a distributed table and enqueues a message
-- writes the coordinator's shard by Citus's local execution, which turns on
-- two-phase commit: the worker's part is prepared (PREPARE TRANSACTION)
-- before the coordinator commits and committed (COMMIT PREPARED) after, so
-- the business write, the key's record and the message commit together or
-- not at all. A failure of the coordinator's commit (a serialization
-- failure raised there) rolls the worker's part back; after the
-- coordinator's crash, Citus's recovery of prepared transactions commits
-- it or rolls it back as the coordinator's commit did or did not happen.
-- (As a plain table of the coordinator's, the outbox was not a node the
-- transaction wrote, for Citus: it committed the worker's part first, on
-- its own.) A relay's statements, its lease with FOR UPDATE SKIP LOCKED
-- among them, run on the one shard; relays connect to the coordinator
-- (through a worker, they are untested).
-- Through a worker, a transaction enqueues too, with two-phase commit on
-- both nodes, but the message's id comes from that worker's range of the
-- sequence, not after those enqueued through other nodes: the order of
-- messages with one ordering key (by id) holds only for messages
-- enqueued through one node, and the notification wakes only relays
-- listening on that worker (the others find the message when they poll).
SELECT citus_add_local_table_to_metadata('outbox_message');

-- goose_db_version, idem_flow_seq and idem_key_lock stay on the coordinator.
