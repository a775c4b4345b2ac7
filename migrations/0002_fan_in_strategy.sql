-- Fan-in strategies. The engine that starts an execution records its default strategy
-- on the execution; each group is created with its stage's strategy, else that default,
-- and stores it, so that every process completing its members decides the same way
-- whatever its own configuration. Only counting strategies keep `remaining`; for the
-- others it is NULL.
ALTER TABLE confluo.execution
    ADD COLUMN fan_in text NOT NULL DEFAULT 'countdown'
        CHECK (fan_in IN ('countdown', 'row_lock', 'naive', 'striped'));
ALTER TABLE confluo.stage_group
    ADD COLUMN fan_in text NOT NULL DEFAULT 'countdown'
        CHECK (fan_in IN ('countdown', 'row_lock', 'naive', 'striped'));
ALTER TABLE confluo.stage_group ALTER COLUMN remaining DROP NOT NULL;
