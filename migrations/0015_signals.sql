-- Signal waits. A signal stage is a group of one task that no user handler runs: the
-- signal completes it (its payload is the task's output), through the ordinary guarded
-- completion and countdown. Its `run_at` is the wait's deadline ('infinity' without
-- one), when the workers' own handler (`confluo:signal`) times it out.
ALTER TABLE confluo.stage_group DROP CONSTRAINT stage_group_kind_check;
ALTER TABLE confluo.stage_group ADD CONSTRAINT stage_group_kind_check
    CHECK (kind IN ('step', 'parallel', 'map', 'branch', 'sleep', 'signal')) NOT VALID;

-- The signals an execution received, one per name: a signal sent before its stage is
-- reached waits here, and the stage receives it when entered. Written and read under
-- the execution's lock, like every stage transition, so a signal and the entry of its
-- stage cannot miss each other.
CREATE TABLE confluo.signal (
    execution_id uuid        NOT NULL REFERENCES confluo.execution (id) ON DELETE CASCADE,
    name         text        NOT NULL,
    payload      jsonb       NOT NULL,
    received_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (execution_id, name)
);
