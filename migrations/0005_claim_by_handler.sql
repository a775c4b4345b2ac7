-- Claiming by handler. A worker claims only the handlers it serves; with the handler in
-- the claim index's leading columns, its claim statement is an equality on the index
-- prefix ordered by the rest (priority, then due time), so the planner has no cheaper
-- choice than walking this index, whatever the table's statistics say. The earlier
-- filter on an expression of both names was estimated at one row on a table with no
-- statistics yet (a fresh table, or a 100 000-row insert autovacuum has not reached), and
-- every claim then sorted the whole backlog.
--
-- `task_claim_idx` stays: claims of any handler (`Engine::claim`) and the queue depth use it.
CREATE INDEX task_claim_handler_idx
    ON confluo.task (workflow_name, handler, priority DESC, run_at)
    WHERE status = 'pending';
