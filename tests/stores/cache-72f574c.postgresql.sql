CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS entries (
        seq BIGSERIAL PRIMARY KEY,
        id TEXT NOT NULL UNIQUE,
        tenant TEXT NOT NULL,
        compat_key TEXT NOT NULL,
        exact_key TEXT,
        prompt TEXT NOT NULL,
        negative_prompt TEXT,
        seed TEXT,
        created DOUBLE PRECISION NOT NULL,
        last_used DOUBLE PRECISION NOT NULL,
        use_count BIGINT NOT NULL DEFAULT 0,
        steps_saved DOUBLE PRECISION NOT NULL DEFAULT 0,
        nbytes BIGINT NOT NULL,
        embedding BYTEA NOT NULL,
        extra TEXT NOT NULL DEFAULT '{}',
        layout TEXT NOT NULL,
        content_key TEXT
    );
ALTER TABLE entries ADD COLUMN IF NOT EXISTS content_key TEXT;
CREATE INDEX IF NOT EXISTS entries_content ON entries (tenant, compat_key, content_key, seq);
CREATE INDEX IF NOT EXISTS entries_scope ON entries (tenant, compat_key, seq);
CREATE INDEX IF NOT EXISTS entries_exact ON entries (tenant, exact_key);
CREATE TABLE IF NOT EXISTS scopes (
        tenant TEXT NOT NULL, compat_key TEXT NOT NULL, dim INTEGER NOT NULL, PRIMARY KEY (tenant, compat_key));
CREATE TABLE IF NOT EXISTS removals (
        seq BIGSERIAL PRIMARY KEY, id TEXT NOT NULL, tenant TEXT NOT NULL, compat_key TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS removals_scope ON removals (tenant, compat_key, seq);
CREATE TABLE IF NOT EXISTS leases (
        tenant TEXT NOT NULL, exact_key TEXT NOT NULL, holder TEXT NOT NULL, host TEXT NOT NULL, pid INTEGER NOT NULL,
        expires DOUBLE PRECISION NOT NULL, PRIMARY KEY (tenant, exact_key));
INSERT INTO meta (key, value) VALUES ('format_version', '2');
INSERT INTO meta (key, value) VALUES ('epoch', '178bd48296b0aec4');
INSERT INTO meta (key, value) VALUES ('total_bytes', '4920');
INSERT INTO entries (seq, id, tenant, compat_key, exact_key, prompt, negative_prompt, seed, created, last_used, use_count, steps_saved, nbytes, embedding, extra, layout, content_key) VALUES (1, '8f3a3a8ea1a04cd391ae8db4d858ef9b', 't', 'k', 'e0', 'a red ball 0', NULL, '0', 1796610802.1368155, 1796610802.1368155, 0, 0.0, 1640, '\x0000803f00000000'::bytea, '{}', '{"blobs":{"8f3a3a8ea1a04cd391ae8db4d858ef9b.tensors.safetensors":{"nbytes":1376,"sha256":"c44327fa25f60a2fb415111415cc45c5e67b1725846949c3cc43c97b8ece7b70"},"8f3a3a8ea1a04cd391ae8db4d858ef9b.video.safetensors":{"nbytes":264,"sha256":"4c1d4a889e46f7c9092c8ee4ecf7808fadc8c68a048cb056cc980edd8156ff90"}},"tensors":{"traj.0":{"blob":"8f3a3a8ea1a04cd391ae8db4d858ef9b.tensors.safetensors","dtype":"F32","nbytes":256,"offset":352,"sha256":"5341e6b2646979a70e57653007a1f310169421ec9bdd9f1a5648f75ade005af1","shape":[64]},"traj.1":{"blob":"8f3a3a8ea1a04cd391ae8db4d858ef9b.tensors.safetensors","dtype":"F32","nbytes":256,"offset":608,"sha256":"2f20cd03c9cd392a406c56232b0ff93a15f6d6d7da79086bfa14f55d4a4031b0","shape":[64]},"traj.2":{"blob":"8f3a3a8ea1a04cd391ae8db4d858ef9b.tensors.safetensors","dtype":"F32","nbytes":256,"offset":864,"sha256":"ed476d0e347082708ceefe747fc955f067313c187689d60dde45f3b87558a84e","shape":[64]},"traj.3":{"blob":"8f3a3a8ea1a04cd391ae8db4d858ef9b.tensors.safetensors","dtype":"F32","nbytes":256,"offset":1120,"sha256":"7d486a55a742938b0bb37e41afcdf8b90b6b8f52956832ca4c5e9a6afabd21ba","shape":[64]},"video":{"blob":"8f3a3a8ea1a04cd391ae8db4d858ef9b.video.safetensors","dtype":"U8","nbytes":96,"offset":168,"sha256":"08359b108fa567f5dcf319fa3434da6abbc1d595f426372666447f09cc5a87dc","shape":[2,4,4,3]}}}', NULL);
INSERT INTO entries (seq, id, tenant, compat_key, exact_key, prompt, negative_prompt, seed, created, last_used, use_count, steps_saved, nbytes, embedding, extra, layout, content_key) VALUES (2, '43317a0bcad445e7b41ff2b9eb5b0aca', 't', 'k', 'e1', 'a red ball 1', NULL, '1', 1796610802.1495671, 1796610802.1495671, 0, 0.0, 1640, '\x0000803f0000803f'::bytea, '{}', '{"blobs":{"43317a0bcad445e7b41ff2b9eb5b0aca.tensors.safetensors":{"nbytes":1376,"sha256":"e4a2c0a6f1d6e2b6aa319fa4a450f3c9bba5a35c894501f38120df6d2c2af711"},"43317a0bcad445e7b41ff2b9eb5b0aca.video.safetensors":{"nbytes":264,"sha256":"17a619ec8ccc2529d91ebf242276876055385ca64979260912d45305e5166b87"}},"tensors":{"traj.0":{"blob":"43317a0bcad445e7b41ff2b9eb5b0aca.tensors.safetensors","dtype":"F32","nbytes":256,"offset":352,"sha256":"2f20cd03c9cd392a406c56232b0ff93a15f6d6d7da79086bfa14f55d4a4031b0","shape":[64]},"traj.1":{"blob":"43317a0bcad445e7b41ff2b9eb5b0aca.tensors.safetensors","dtype":"F32","nbytes":256,"offset":608,"sha256":"ed476d0e347082708ceefe747fc955f067313c187689d60dde45f3b87558a84e","shape":[64]},"traj.2":{"blob":"43317a0bcad445e7b41ff2b9eb5b0aca.tensors.safetensors","dtype":"F32","nbytes":256,"offset":864,"sha256":"7d486a55a742938b0bb37e41afcdf8b90b6b8f52956832ca4c5e9a6afabd21ba","shape":[64]},"traj.3":{"blob":"43317a0bcad445e7b41ff2b9eb5b0aca.tensors.safetensors","dtype":"F32","nbytes":256,"offset":1120,"sha256":"ca0ee7dd7490328fe44c68a0f38bbd4f838afb5620f03decba6d35fc9dd41f96","shape":[64]},"video":{"blob":"43317a0bcad445e7b41ff2b9eb5b0aca.video.safetensors","dtype":"U8","nbytes":96,"offset":168,"sha256":"08359b108fa567f5dcf319fa3434da6abbc1d595f426372666447f09cc5a87dc","shape":[2,4,4,3]}}}', 'c');
INSERT INTO entries (seq, id, tenant, compat_key, exact_key, prompt, negative_prompt, seed, created, last_used, use_count, steps_saved, nbytes, embedding, extra, layout, content_key) VALUES (3, '939c07e2ecde4e959eb7f0a263112d6a', 't', 'k', 'e2', 'a red ball 2', NULL, '2', 1796610802.1608317, 1796610802.1608317, 0, 0.0, 1640, '\x0000803f00000040'::bytea, '{}', '{"blobs":{"939c07e2ecde4e959eb7f0a263112d6a.tensors.safetensors":{"nbytes":1376,"sha256":"7957fc8508be893c017a8611f818867ad176226a4b5ce282a6cef84d936f03ac"},"939c07e2ecde4e959eb7f0a263112d6a.video.safetensors":{"nbytes":264,"sha256":"1b23acdab84fac40422d427b9d808cc03d16f48bceacde27663121ee912d1620"}},"tensors":{"traj.0":{"blob":"939c07e2ecde4e959eb7f0a263112d6a.tensors.safetensors","dtype":"F32","nbytes":256,"offset":352,"sha256":"ed476d0e347082708ceefe747fc955f067313c187689d60dde45f3b87558a84e","shape":[64]},"traj.1":{"blob":"939c07e2ecde4e959eb7f0a263112d6a.tensors.safetensors","dtype":"F32","nbytes":256,"offset":608,"sha256":"7d486a55a742938b0bb37e41afcdf8b90b6b8f52956832ca4c5e9a6afabd21ba","shape":[64]},"traj.2":{"blob":"939c07e2ecde4e959eb7f0a263112d6a.tensors.safetensors","dtype":"F32","nbytes":256,"offset":864,"sha256":"ca0ee7dd7490328fe44c68a0f38bbd4f838afb5620f03decba6d35fc9dd41f96","shape":[64]},"traj.3":{"blob":"939c07e2ecde4e959eb7f0a263112d6a.tensors.safetensors","dtype":"F32","nbytes":256,"offset":1120,"sha256":"6547e92d968f155ee65d806e41bd7bf17fe0dc72c7d9896febd6aa577ba03894","shape":[64]},"video":{"blob":"939c07e2ecde4e959eb7f0a263112d6a.video.safetensors","dtype":"U8","nbytes":96,"offset":168,"sha256":"08359b108fa567f5dcf319fa3434da6abbc1d595f426372666447f09cc5a87dc","shape":[2,4,4,3]}}}', NULL);
INSERT INTO scopes (tenant, compat_key, dim) VALUES ('t', 'k', 2);
SELECT setval(pg_get_serial_sequence('entries', 'seq'), (SELECT coalesce(max(seq), 0) + 1 FROM entries), false);
SELECT setval(pg_get_serial_sequence('removals', 'seq'), (SELECT coalesce(max(seq), 0) + 1 FROM removals), false);
