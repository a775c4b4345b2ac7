-- Striped countdown: a wide group's count is spread over `stripes` rows; member i counts
-- down stripe (i / stripe_run) % stripes, and the one arrival that drains a stripe counts
-- down the group row, whose `remaining` then counts undrained stripes. Exactly one arrival
-- still sees the group at zero, and each lock-holding commit contends with 1/stripes of
-- the others. Runs of `stripe_run` consecutive members share a stripe, so that a batch of
-- them is one stripe decrement.
ALTER TABLE confluo.stage_group
    ADD COLUMN stripes integer NOT NULL DEFAULT 1 CHECK (stripes > 0),
    ADD COLUMN stripe_run integer NOT NULL DEFAULT 1 CHECK (stripe_run > 0);

-- The one definition of which stripe a member counts down.
CREATE FUNCTION confluo.stripe_of(item_index integer, stripe_run integer, stripes integer)
    RETURNS integer LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN (item_index / stripe_run) % stripes;

CREATE TABLE confluo.group_stripe (
    group_id   uuid    NOT NULL REFERENCES confluo.stage_group (id) ON DELETE CASCADE,
    stripe     integer NOT NULL CHECK (stripe >= 0),
    remaining  integer NOT NULL CHECK (remaining >= 0),
    PRIMARY KEY (group_id, stripe)
) WITH (fillfactor = 50);
