-- Reclaiming expired leases, through an index the planner cannot take for a lookup.
--
-- `task_lease_idx` (0001) was partial on `status = 'running'`. On a table last analyzed
-- while no task ran (autovacuum's ANALYZE after a big insert, or a user's), the planner
-- estimates that index empty, so it chose it over the primary key for every statement
-- that matches a running task by id, and then filtered every running task for each one:
-- an acknowledgement batch of 512 cost 512 x (running tasks) comparisons.
--
-- The same index keyed on what the reclaim reads, partial on `lease_expires_at IS NOT
-- NULL`: every transition out of `running` clears `lease_expires_at`, so it holds exactly
-- the running tasks, the reclaim's `lease_expires_at < now()` implies its predicate, and
-- a lookup by id (`status = 'running'` does not imply it) can no longer use it.
CREATE INDEX task_lease_expiry_idx ON confluo.task (lease_expires_at)
    WHERE lease_expires_at IS NOT NULL;
DROP INDEX confluo.task_lease_idx;
