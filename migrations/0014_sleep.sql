-- Durable sleep. A sleep stage is a group of one task, due at the wake time (its
-- `run_at`), that workers run with a handler of their own (`confluo:sleep`): a row with a
-- due time, so a sleep survives every restart. The stage after it reads what the sleep
-- received: the sleep's group records that input stage, and its own output (null) is
-- never read.
ALTER TABLE confluo.stage_group DROP CONSTRAINT stage_group_kind_check;
ALTER TABLE confluo.stage_group ADD CONSTRAINT stage_group_kind_check
    CHECK (kind IN ('step', 'parallel', 'map', 'branch', 'sleep')) NOT VALID;
