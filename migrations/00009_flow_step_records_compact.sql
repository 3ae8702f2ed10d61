-- +goose Up
-- From this version on, idem writes the record of each step in a flow's row
-- (idem_flow.steps, by place) as a JSON string of a compact form, not a JSON
-- object: it reads both, and nothing is rewritten here. The form, where a
-- local step that returned 1 reads "7,0;reserve1" (50 bytes as an object):
--   name length,completed,state,attempts,first called,reconciles,outcome length;name outcome result
-- lengths in characters; state empty for a step done, c for a call calling,
-- u for one unsent; times in microseconds after the flow's created_at, or
-- since 1970 after an @; empty fields 0 or not set, left out at the
-- header's end; the result (JSON) the rest, none when empty. An executor of
-- the version before cannot read such a record; each write of them carries
-- the key "v" (9, this form), which is no place, so that the claim of that
-- version fails on the flow before it runs anything (docs/migrations.md,
-- "Rolling deploys"). Going down turns every such record back into the
-- object that version reads, and takes the key away.
COMMENT ON COLUMN idem_flow.steps IS
    'the steps'' records by place: compact strings (migration 00009), or objects of short fields (00008)';

-- +goose Down
UPDATE idem_flow AS f
SET steps = (
    SELECT jsonb_object_agg(s.key, CASE
        WHEN jsonb_typeof(s.value) <> 'string' THEN s.value
        ELSE jsonb_strip_nulls(jsonb_build_object(
                 'n', substr(r.rest, 1, r.nl),
                 's', CASE r.st WHEN 'c' THEN 'calling' WHEN 'u' THEN 'unsent' END,
                 'a', nullif(r.a, '')::int,
                 'f', CASE WHEN r.fc = '' THEN NULL WHEN left(r.fc, 1) = '@' THEN substr(r.fc, 2)::bigint
                           ELSE (extract(epoch FROM f.created_at) * 1000000)::bigint + r.fc::bigint END,
                 'c', CASE WHEN r.c = '' THEN NULL WHEN left(r.c, 1) = '@' THEN substr(r.c, 2)::bigint
                           ELSE (extract(epoch FROM f.created_at) * 1000000)::bigint + r.c::bigint END,
                 'x', nullif(r.x, '')::int,
                 'l', nullif(substr(r.rest, r.nl + 1, r.ll), '')))
             -- The result after the others: a JSON null in it is kept.
             || CASE WHEN length(r.rest) > r.nl + r.ll THEN jsonb_build_object('r', substr(r.rest, r.nl + r.ll + 1)::jsonb)
                     ELSE '{}'::jsonb END
        END)
    FROM jsonb_each(f.steps) AS s,
         LATERAL (SELECT CASE WHEN jsonb_typeof(s.value) = 'string' THEN split_part(s.value #>> '{}', ';', 1)
                              ELSE '0' END AS h) AS p,
         LATERAL (SELECT split_part(p.h, ',', 1)::int AS nl,
                         split_part(p.h, ',', 2) AS c,
                         split_part(p.h, ',', 3) AS st,
                         split_part(p.h, ',', 4) AS a,
                         split_part(p.h, ',', 5) AS fc,
                         split_part(p.h, ',', 6) AS x,
                         coalesce(nullif(split_part(p.h, ',', 7), ''), '0')::int AS ll,
                         substr(s.value #>> '{}', length(p.h) + 2) AS rest) AS r
    WHERE s.key <> 'v'
)
WHERE f.steps IS NOT NULL;
COMMENT ON COLUMN idem_flow.steps IS NULL;
