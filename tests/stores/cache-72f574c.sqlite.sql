BEGIN TRANSACTION;
CREATE TABLE entries (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        id TEXT NOT NULL UNIQUE,
        tenant TEXT NOT NULL,
        compat_key TEXT NOT NULL,
        exact_key TEXT,
        prompt TEXT NOT NULL,
        negative_prompt TEXT,
        seed TEXT,
        created REAL NOT NULL,
        last_used REAL NOT NULL,
        use_count INTEGER NOT NULL DEFAULT 0,
        steps_saved REAL NOT NULL DEFAULT 0,
        nbytes INTEGER NOT NULL,
        embedding BLOB NOT NULL,
        extra TEXT NOT NULL DEFAULT '{}',
        layout TEXT NOT NULL,
        content_key TEXT
    );
INSERT INTO "entries" VALUES(1,'c233e96f8f24413e824a62e403a7a4d4','t','k','e0','a red ball 0',NULL,'0',1.7966108007895617485e+09,1.7966108007895617485e+09,0,0.0,1640,X'0000803F00000000','{}','{"blobs":{"c233e96f8f24413e824a62e403a7a4d4.tensors.safetensors":{"nbytes":1376,"sha256":"625ad4b3d45a0de45d452254a3c8f8c0a10bdcbfda1243a7af97b258a7c3967b"},"c233e96f8f24413e824a62e403a7a4d4.video.safetensors":{"nbytes":264,"sha256":"03656a2d5bb78308178f4e12145c5e88d89027775935ea2ce398d01680d286b9"}},"tensors":{"traj.0":{"blob":"c233e96f8f24413e824a62e403a7a4d4.tensors.safetensors","dtype":"F32","nbytes":256,"offset":352,"sha256":"5341e6b2646979a70e57653007a1f310169421ec9bdd9f1a5648f75ade005af1","shape":[64]},"traj.1":{"blob":"c233e96f8f24413e824a62e403a7a4d4.tensors.safetensors","dtype":"F32","nbytes":256,"offset":608,"sha256":"2f20cd03c9cd392a406c56232b0ff93a15f6d6d7da79086bfa14f55d4a4031b0","shape":[64]},"traj.2":{"blob":"c233e96f8f24413e824a62e403a7a4d4.tensors.safetensors","dtype":"F32","nbytes":256,"offset":864,"sha256":"ed476d0e347082708ceefe747fc955f067313c187689d60dde45f3b87558a84e","shape":[64]},"traj.3":{"blob":"c233e96f8f24413e824a62e403a7a4d4.tensors.safetensors","dtype":"F32","nbytes":256,"offset":1120,"sha256":"7d486a55a742938b0bb37e41afcdf8b90b6b8f52956832ca4c5e9a6afabd21ba","shape":[64]},"video":{"blob":"c233e96f8f24413e824a62e403a7a4d4.video.safetensors","dtype":"U8","nbytes":96,"offset":168,"sha256":"08359b108fa567f5dcf319fa3434da6abbc1d595f426372666447f09cc5a87dc","shape":[2,4,4,3]}}}',NULL);
INSERT INTO "entries" VALUES(2,'79689939989c49828fb4caa4c1d6cbd4','t','k','e1','a red ball 1',NULL,'1',1.79661080081374025345e+09,1.79661080081374025345e+09,0,0.0,1640,X'0000803F0000803F','{}','{"blobs":{"79689939989c49828fb4caa4c1d6cbd4.tensors.safetensors":{"nbytes":1376,"sha256":"661e39ea29371c017c1a32aef8d774557211e26167bd4f7f84962b3dcae5e687"},"79689939989c49828fb4caa4c1d6cbd4.video.safetensors":{"nbytes":264,"sha256":"4f7c819bd3f5bbce82a5e8098062e1c790b4325973019465290a4cc043d196af"}},"tensors":{"traj.0":{"blob":"79689939989c49828fb4caa4c1d6cbd4.tensors.safetensors","dtype":"F32","nbytes":256,"offset":352,"sha256":"2f20cd03c9cd392a406c56232b0ff93a15f6d6d7da79086bfa14f55d4a4031b0","shape":[64]},"traj.1":{"blob":"79689939989c49828fb4caa4c1d6cbd4.tensors.safetensors","dtype":"F32","nbytes":256,"offset":608,"sha256":"ed476d0e347082708ceefe747fc955f067313c187689d60dde45f3b87558a84e","shape":[64]},"traj.2":{"blob":"79689939989c49828fb4caa4c1d6cbd4.tensors.safetensors","dtype":"F32","nbytes":256,"offset":864,"sha256":"7d486a55a742938b0bb37e41afcdf8b90b6b8f52956832ca4c5e9a6afabd21ba","shape":[64]},"traj.3":{"blob":"79689939989c49828fb4caa4c1d6cbd4.tensors.safetensors","dtype":"F32","nbytes":256,"offset":1120,"sha256":"ca0ee7dd7490328fe44c68a0f38bbd4f838afb5620f03decba6d35fc9dd41f96","shape":[64]},"video":{"blob":"79689939989c49828fb4caa4c1d6cbd4.video.safetensors","dtype":"U8","nbytes":96,"offset":168,"sha256":"08359b108fa567f5dcf319fa3434da6abbc1d595f426372666447f09cc5a87dc","shape":[2,4,4,3]}}}','c');
INSERT INTO "entries" VALUES(3,'ade4fb04beab4df5b98b854d8cfa87ee','t','k','e2','a red ball 2',NULL,'2',1.79661080083754873268e+09,1.79661080083754873268e+09,0,0.0,1640,X'0000803F00000040','{}','{"blobs":{"ade4fb04beab4df5b98b854d8cfa87ee.tensors.safetensors":{"nbytes":1376,"sha256":"f649b7ed94f350ab85b2a500476bac75f65f0186f2ecdf873606f0ac07813d64"},"ade4fb04beab4df5b98b854d8cfa87ee.video.safetensors":{"nbytes":264,"sha256":"a591c52576c78a1730f5974b2312c500cf1f55d21cd193b0fdfa5e14518b3af2"}},"tensors":{"traj.0":{"blob":"ade4fb04beab4df5b98b854d8cfa87ee.tensors.safetensors","dtype":"F32","nbytes":256,"offset":352,"sha256":"ed476d0e347082708ceefe747fc955f067313c187689d60dde45f3b87558a84e","shape":[64]},"traj.1":{"blob":"ade4fb04beab4df5b98b854d8cfa87ee.tensors.safetensors","dtype":"F32","nbytes":256,"offset":608,"sha256":"7d486a55a742938b0bb37e41afcdf8b90b6b8f52956832ca4c5e9a6afabd21ba","shape":[64]},"traj.2":{"blob":"ade4fb04beab4df5b98b854d8cfa87ee.tensors.safetensors","dtype":"F32","nbytes":256,"offset":864,"sha256":"ca0ee7dd7490328fe44c68a0f38bbd4f838afb5620f03decba6d35fc9dd41f96","shape":[64]},"traj.3":{"blob":"ade4fb04beab4df5b98b854d8cfa87ee.tensors.safetensors","dtype":"F32","nbytes":256,"offset":1120,"sha256":"6547e92d968f155ee65d806e41bd7bf17fe0dc72c7d9896febd6aa577ba03894","shape":[64]},"video":{"blob":"ade4fb04beab4df5b98b854d8cfa87ee.video.safetensors","dtype":"U8","nbytes":96,"offset":168,"sha256":"08359b108fa567f5dcf319fa3434da6abbc1d595f426372666447f09cc5a87dc","shape":[2,4,4,3]}}}',NULL);
CREATE TABLE leases (
        tenant TEXT NOT NULL,
        exact_key TEXT NOT NULL,
        holder TEXT NOT NULL,
        host TEXT NOT NULL,
        pid INTEGER NOT NULL,
        expires REAL NOT NULL,
        PRIMARY KEY (tenant, exact_key)
    );
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
INSERT INTO "meta" VALUES('format_version','2');
INSERT INTO "meta" VALUES('epoch','32e11ff0c31b4405');
INSERT INTO "meta" VALUES('capacity_bytes','10000000');
INSERT INTO "meta" VALUES('eviction','lru');
CREATE TABLE removals (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        id TEXT NOT NULL,
        tenant TEXT NOT NULL,
        compat_key TEXT NOT NULL
    );
CREATE TABLE scopes (
        tenant TEXT NOT NULL,
        compat_key TEXT NOT NULL,
        dim INTEGER NOT NULL,
        PRIMARY KEY (tenant, compat_key)
    );
INSERT INTO "scopes" VALUES('t','k',2);
CREATE INDEX entries_scope ON entries (tenant, compat_key, seq);
CREATE INDEX entries_exact ON entries (tenant, exact_key);
CREATE INDEX entries_content ON entries (tenant, compat_key, content_key, seq);
DELETE FROM "sqlite_sequence";
INSERT INTO "sqlite_sequence" VALUES('entries',3);
COMMIT;
