-- Dependency fan-in (a DAG): a stage that waits for several stages of its workflow's list
-- keeps a countdown of the dependencies not finished yet, one row per (execution, stage).
-- The first dependency to finish creates it; each decrements it, in the transaction that
-- finishes the dependency, which holds the execution's lock; the one that brings it to
-- zero enters the stage (whose group is still guarded by (execution_id, stage_index)).
CREATE TABLE confluo.stage_join (
    execution_id uuid    NOT NULL REFERENCES confluo.execution (id) ON DELETE CASCADE,
    -- The waiting stage.
    stage_index  integer NOT NULL CHECK (stage_index >= 0),
    remaining    integer NOT NULL CHECK (remaining >= 0),
    -- Each dependency that finished, by stage name: the group whose output it passes on
    -- (JSON null: the execution input).
    arrived      jsonb   NOT NULL DEFAULT '{}',
    created_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (execution_id, stage_index)
);
