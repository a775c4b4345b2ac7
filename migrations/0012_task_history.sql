-- Finished tasks leave the hot table. `confluo.task` holds the tasks of running
-- executions (and of executions that ended a moment ago); a worker's housekeeping moves
-- the tasks of every execution that ended more than a while ago (`archive_after`) into
-- `confluo.task_history`, which nothing claims from and nothing updates. So the table
-- that claims, completions and the lease sweep work on holds the work in flight, not the
-- history: autovacuum's thresholds (a fraction of the table) stay small, each vacuum of
-- it is quick, and retention (`purge`) deletes from the history, never from it.
--
-- A reprocess of an archived (failed) execution's dead letter moves its tasks back first.
--
-- The two tables have the same columns in the same order: the move is
-- `INSERT INTO task_history SELECT * FROM (DELETE FROM task ... RETURNING *)`, which
-- fails loudly if they ever differ. A migration that adds a column to `confluo.task`
-- adds it to `confluo.task_history` too, and recreates `confluo.task_all` (tests/schema
-- checks the columns).
CREATE TABLE confluo.task_history (
    LIKE confluo.task INCLUDING DEFAULTS INCLUDING CONSTRAINTS,
    PRIMARY KEY (id),
    UNIQUE (group_id, item_index),
    -- Purge deletes executions; their history goes with them.
    FOREIGN KEY (execution_id) REFERENCES confluo.execution (id) ON DELETE CASCADE
);
CREATE INDEX task_history_execution_idx ON confluo.task_history (execution_id, status);
-- Listing dead letters, newest first (as `task_dead_idx` on the hot table).
CREATE INDEX task_history_dead_idx ON confluo.task_history (finished_at DESC)
    WHERE status = 'dead';

-- Every task, wherever it is: what readers of finished work use (inspect, outputs,
-- members, dead letters, activity). A row is in exactly one of the two tables in any
-- snapshot: it moves in one statement.
CREATE VIEW confluo.task_all AS
    SELECT * FROM confluo.task
    UNION ALL
    SELECT * FROM confluo.task_history;

-- When the execution's tasks were moved to the history; NULL while they are in the hot
-- table. Executions that ended before this migration are archived by the first workers
-- that run it, a batch at a time.
ALTER TABLE confluo.execution ADD COLUMN archived_at timestamptz;
CREATE INDEX execution_unarchived_idx ON confluo.execution (finished_at)
    WHERE archived_at IS NULL AND status <> 'running';
