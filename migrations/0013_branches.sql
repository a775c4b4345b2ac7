-- Conditional branches. A branch stage runs no task: the transaction that fires the stage
-- before it picks an arm and records a group of width 0, fired at once, with the choice.
-- Its arms' stages are numbered after it (see src/definition/plan.rs), so the stage whose
-- output a group reads as its input is no longer always the one numbered just before it.
ALTER TABLE confluo.stage_group
    -- The stage whose output is this group's input: -1 for the execution input. NULL on
    -- groups created before this migration, which read the stage numbered before them
    -- (`stage_index - 1`, -1 for the first); readers use that as the default, so no row
    -- is rewritten here.
    ADD COLUMN input_stage integer,
    -- A branch's choice: {"arm": <its value, or null for otherwise>, "value": <selected>}.
    ADD COLUMN branch jsonb,
    ADD CONSTRAINT stage_group_branch_check CHECK ((kind = 'branch') = (branch IS NOT NULL)
                                                   AND (kind <> 'branch' OR width = 0)) NOT VALID,
    ADD CONSTRAINT stage_group_input_stage_check
        CHECK (input_stage >= -1 AND input_stage < stage_index) NOT VALID;

ALTER TABLE confluo.stage_group DROP CONSTRAINT stage_group_kind_check;
ALTER TABLE confluo.stage_group ADD CONSTRAINT stage_group_kind_check
    CHECK (kind IN ('step', 'parallel', 'map', 'branch')) NOT VALID;

-- The constraints are NOT VALID so that this migration does not scan the table: rows
-- written from now on are checked; rows from before could not break them (they have no
-- branch and no input_stage).
