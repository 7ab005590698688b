CREATE TABLE IF NOT EXISTS carnator_jobs (
        seq BIGSERIAL PRIMARY KEY,
        id TEXT UNIQUE NOT NULL,
        tenant TEXT NOT NULL,
        status TEXT NOT NULL,
        params TEXT NOT NULL,
        idempotency_key TEXT,
        request_hash TEXT,
        progress INTEGER NOT NULL DEFAULT 0,
        attempts INTEGER NOT NULL DEFAULT 0,
        cancel_requested BOOLEAN NOT NULL DEFAULT FALSE,
        worker TEXT,
        created_at DOUBLE PRECISION NOT NULL,
        started_at DOUBLE PRECISION,
        completed_at DOUBLE PRECISION,
        error TEXT,
        stats TEXT,
        videos TEXT
    );
CREATE UNIQUE INDEX IF NOT EXISTS carnator_jobs_idempotency ON carnator_jobs (tenant, idempotency_key) WHERE idempotency_key IS NOT NULL;
CREATE INDEX IF NOT EXISTS carnator_jobs_queue ON carnator_jobs (status, tenant, seq);
CREATE INDEX IF NOT EXISTS carnator_jobs_tenant ON carnator_jobs (tenant, seq);
CREATE TABLE IF NOT EXISTS carnator_job_events (
        seq BIGSERIAL PRIMARY KEY,
        job_id TEXT NOT NULL,
        kind TEXT NOT NULL,
        attempt INTEGER NOT NULL,
        at DOUBLE PRECISION NOT NULL,
        detail TEXT
    );
CREATE INDEX IF NOT EXISTS carnator_job_events_job ON carnator_job_events (job_id, seq);
INSERT INTO carnator_jobs (seq, id, tenant, status, params, idempotency_key, request_hash, progress, attempts, cancel_requested, worker, created_at, started_at, completed_at, error, stats, videos) VALUES (1, 'video_18837951507042eaa57d25655b12359e', 'alpha', 'completed', '{"prompt": "a red ball", "seed": 1}', 'k1', 'h1', 100, 1, false, 'w0', 1796609849.5678737, 1796609849.569716, 1796609849.575232, NULL, '{"tier": "miss"}', '["mp4"]');
INSERT INTO carnator_jobs (seq, id, tenant, status, params, idempotency_key, request_hash, progress, attempts, cancel_requested, worker, created_at, started_at, completed_at, error, stats, videos) VALUES (2, 'video_9cc60d0f511349009503960f9aca1460', 'alpha', 'in_progress', '{"prompt": "a blue ball", "seed": 2}', NULL, NULL, 40, 1, false, 'w0', 1796609849.5813925, 1796609849.5822835, NULL, NULL, NULL, NULL);
INSERT INTO carnator_jobs (seq, id, tenant, status, params, idempotency_key, request_hash, progress, attempts, cancel_requested, worker, created_at, started_at, completed_at, error, stats, videos) VALUES (3, 'video_44d89df148274cc9872651afc193f444', 'bravo', 'queued', '{"prompt": "a green ball", "seed": 3}', NULL, NULL, 0, 0, false, NULL, 1796609849.5837786, NULL, NULL, NULL, NULL, NULL);
SELECT setval(pg_get_serial_sequence('carnator_jobs', 'seq'), (SELECT max(seq) FROM carnator_jobs));
INSERT INTO carnator_job_events (seq, job_id, kind, attempt, at, detail) VALUES (1, 'video_18837951507042eaa57d25655b12359e', 'submitted', 0, 1796609849.5685003, NULL);
INSERT INTO carnator_job_events (seq, job_id, kind, attempt, at, detail) VALUES (2, 'video_18837951507042eaa57d25655b12359e', 'claimed', 1, 1796609849.5704012, 'w0');
INSERT INTO carnator_job_events (seq, job_id, kind, attempt, at, detail) VALUES (3, 'video_18837951507042eaa57d25655b12359e', 'completed', 1, 1796609849.5805058, NULL);
INSERT INTO carnator_job_events (seq, job_id, kind, attempt, at, detail) VALUES (4, 'video_9cc60d0f511349009503960f9aca1460', 'submitted', 0, 1796609849.581647, NULL);
INSERT INTO carnator_job_events (seq, job_id, kind, attempt, at, detail) VALUES (5, 'video_9cc60d0f511349009503960f9aca1460', 'claimed', 1, 1796609849.5827644, 'w0');
INSERT INTO carnator_job_events (seq, job_id, kind, attempt, at, detail) VALUES (6, 'video_44d89df148274cc9872651afc193f444', 'submitted', 0, 1796609849.5839949, NULL);
SELECT setval(pg_get_serial_sequence('carnator_job_events', 'seq'), (SELECT max(seq) FROM carnator_job_events));
