-- Join rules for parallel and map stages: `all` (every member terminal, as before), `any`
-- and `at_least(k)` (a quorum). A quorum group keeps, on its countdown row beside
-- `remaining`, two more counters moved by the same statements that write its members'
-- terminal statuses: `needed`, the successes it still needs (k minus the members
-- completed), and `tolerable`, the dead members it can still absorb (width minus k minus
-- the members dead-lettered). The one statement that takes `needed` from above zero to
-- zero or below fires the group; the one that takes `tolerable` below zero fails the
-- stage. Both move on the same row, so they are serialized, and they cannot both cross:
-- k successes and width - k + 1 failures would be more members than the group has.
-- NULL on every group of an `all` stage, and on every group created before this.
ALTER TABLE confluo.stage_group
    ADD COLUMN quorum    integer,
    ADD COLUMN needed    integer,
    ADD COLUMN tolerable integer,
    ADD CONSTRAINT stage_group_quorum_check
        CHECK ((quorum IS NULL) = (needed IS NULL) AND (quorum IS NULL) = (tolerable IS NULL)
               AND (quorum IS NULL OR quorum >= 1)) NOT VALID;
-- NOT VALID: rows from before have no quorum and cannot break it; no scan here.
