-- Execution deadlines and dead-letter reprocessing.
--
-- An execution may carry a deadline; once it passes, a worker's sweep moves the execution
-- to `timed_out` and cancels its pending tasks in the same transaction (as a cancel does).
ALTER TABLE confluo.execution DROP CONSTRAINT execution_status_check;
-- NOT VALID, then VALIDATE: the scan of existing rows runs without blocking writes.
ALTER TABLE confluo.execution ADD CONSTRAINT execution_status_check
    CHECK (status IN ('running', 'completed', 'failed', 'cancelled', 'timed_out')) NOT VALID;
ALTER TABLE confluo.execution VALIDATE CONSTRAINT execution_status_check;
ALTER TABLE confluo.execution ADD COLUMN deadline_at timestamptz;
CREATE INDEX execution_deadline_idx ON confluo.execution (deadline_at)
    WHERE status = 'running' AND deadline_at IS NOT NULL;

-- How many times a dead-lettered task was put back in the queue by an operator; its
-- attempt count starts again from 0 each time, its error history is kept.
ALTER TABLE confluo.task ADD COLUMN reprocessed integer NOT NULL DEFAULT 0;

-- Listing dead letters, newest first.
CREATE INDEX task_dead_idx ON confluo.task (finished_at DESC) WHERE status = 'dead';
