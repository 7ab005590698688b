BEGIN TRANSACTION;
CREATE TABLE job_log (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        job_id TEXT NOT NULL,
        kind TEXT NOT NULL,
        attempt INTEGER NOT NULL,
        at REAL NOT NULL,
        detail TEXT
    );
INSERT INTO "job_log" VALUES(1,'video_9b61b5107cdb4598a651e60be4ae38c8','submitted',0,1.79660984770478796956e+09,NULL);
INSERT INTO "job_log" VALUES(2,'video_9b61b5107cdb4598a651e60be4ae38c8','claimed',1,1.79660984770579791073e+09,'w0');
INSERT INTO "job_log" VALUES(3,'video_9b61b5107cdb4598a651e60be4ae38c8','completed',1,1.79660984771352934836e+09,NULL);
INSERT INTO "job_log" VALUES(4,'video_e5200a2a54ba4768b60a46e8fed5d152','submitted',0,1.7966098477143514156e+09,NULL);
INSERT INTO "job_log" VALUES(5,'video_e5200a2a54ba4768b60a46e8fed5d152','claimed',1,1.79660984771486616131e+09,'w0');
INSERT INTO "job_log" VALUES(6,'video_9d3644b2a3534853828de2e4168298b7','submitted',0,1.79660984771606016159e+09,NULL);
CREATE TABLE jobs (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        id TEXT UNIQUE NOT NULL,
        tenant TEXT NOT NULL,
        status TEXT NOT NULL,
        params TEXT NOT NULL,
        idempotency_key TEXT,
        request_hash TEXT,
        progress INTEGER NOT NULL DEFAULT 0,
        attempts INTEGER NOT NULL DEFAULT 0,
        cancel_requested INTEGER NOT NULL DEFAULT 0,
        worker TEXT,
        created_at REAL NOT NULL,
        started_at REAL,
        completed_at REAL,
        error TEXT,
        stats TEXT,
        videos TEXT
    );
INSERT INTO "jobs" VALUES(1,'video_9b61b5107cdb4598a651e60be4ae38c8','alpha','completed','{"prompt": "a red ball", "seed": 1}','k1','h1',100,1,0,'w0',1.79660984770469641684e+09,1.79660984770568656924e+09,1.79660984771342635158e+09,NULL,'{"tier": "miss"}','["mp4"]');
INSERT INTO "jobs" VALUES(2,'video_e5200a2a54ba4768b60a46e8fed5d152','alpha','in_progress','{"prompt": "a blue ball", "seed": 2}',NULL,NULL,40,1,0,'w0',1.79660984771430349343e+09,1.79660984771479964256e+09,NULL,NULL,NULL,NULL);
INSERT INTO "jobs" VALUES(3,'video_9d3644b2a3534853828de2e4168298b7','bravo','queued','{"prompt": "a green ball", "seed": 3}',NULL,NULL,0,0,0,NULL,1.7966098477160191536e+09,NULL,NULL,NULL,NULL,NULL);
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
INSERT INTO "meta" VALUES('schema','1');
CREATE UNIQUE INDEX jobs_idempotency ON jobs (tenant, idempotency_key) WHERE idempotency_key IS NOT NULL;
CREATE INDEX jobs_queue ON jobs (status, tenant, seq);
CREATE INDEX jobs_tenant ON jobs (tenant, seq);
CREATE INDEX job_log_job ON job_log (job_id, seq);
DELETE FROM "sqlite_sequence";
INSERT INTO "sqlite_sequence" VALUES('jobs',3);
INSERT INTO "sqlite_sequence" VALUES('job_log',6);
COMMIT;
