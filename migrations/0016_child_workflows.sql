-- Child workflows. A map_workflow stage is a map whose members no user handler runs:
-- each member task is due at 'infinity', and the transaction that creates it starts one
-- execution of the child workflow for it (`parent_task`). The transaction that ends a
-- child makes its member due at once; the workers' own handler (`confluo:child`) then
-- completes the member with the child's output, or fails it with the child's error,
-- through the ordinary guarded completion and countdown.
ALTER TABLE confluo.stage_group DROP CONSTRAINT stage_group_kind_check;
ALTER TABLE confluo.stage_group ADD CONSTRAINT stage_group_kind_check
    CHECK (kind IN ('step', 'parallel', 'map', 'branch', 'sleep', 'signal', 'map_workflow'))
    NOT VALID;

-- No foreign keys: a parent's tasks move to the task history once it has ended, and an
-- ended parent may be purged before its cancelled children are.
ALTER TABLE confluo.execution
    ADD COLUMN parent_execution uuid,
    ADD COLUMN parent_task uuid;
CREATE INDEX execution_parent_idx ON confluo.execution (parent_execution)
    WHERE parent_execution IS NOT NULL;
CREATE INDEX execution_parent_task_idx ON confluo.execution (parent_task)
    WHERE parent_task IS NOT NULL;

-- Executions that stopped (cancelled, failed, timed out) while children of theirs ran:
-- the children are cancelled after the stop commits, in batches, by the canceller and by
-- the workers' housekeeping, which deletes the row once none runs. A stop never locks
-- its children itself: a child's end locks its own rows before its parent's member, so
-- a stop that locked the parent's members and then the children could deadlock with it.
CREATE TABLE confluo.cascade (
    execution_id uuid        PRIMARY KEY,
    stopped_at   timestamptz NOT NULL DEFAULT now()
);
