/* Verifies a signed Cuvil library before it loads it, then runs it once: the C side of docs/deployment.md.
 *
 *   cuvil keygen --private key.pem --public pub.pem
 *   cuvil compile model.onnx -o build/libmodel.so && cuvil sign build/libmodel.so --key key.pem
 *   cc -O2 examples/c/verify_and_load.c -lcrypto -ldl -o verify_and_load
 *   ./verify_and_load pub.pem build/libmodel.so [PREFIX]
 *
 * What it checks, in order, before any byte of the library is mapped:
 *  1. build/libmodel.sig, the OpenSSF model-signing signature `cuvil sign` wrote: a Sigstore bundle (JSON) with
 *     a DSSE envelope. The ECDSA signature (DER, SHA-256 for a P-256 key) must hold over the DSSE
 *     pre-authentication encoding PAE("application/vnd.in-toto+json", payload) with the public key given.
 *     (The bundle's public-key hint is not read: it is not signed, so it proves nothing.)
 *  2. The payload, an in-toto statement: its predicate lists every signed file with its SHA-256 (resources),
 *     and its subject digest is SHA-256 over those digests in order (checked too).
 *  3. Each signed file is read ONCE into memory and its SHA-256 compared; the library must be among them, and
 *     a sidecar of the library (.h, .manifest.json, .cdx.json, .intoto.json, .weights) present but unsigned is
 *     refused, as `cuvil verify-artifact` does.
 * Then the library's verified bytes are copied into a sealed memfd (no write, shrink or grow; seals sealed)
 * and dlopen'ed through /proc/self/fd/N: nothing on disk can change what runs after the check. Its inputs are
 * filled with a fixed pattern (float32: 0.1 * (i % 7) - 0.3; other types zero; a symbolic dim at 1), it runs
 * once, and each output's name, shape and first values are printed.
 *
 * A library compiled with --external-weights gets the verified bytes of its libNAME.weights, from memory, through
 * PREFIX_bind_weights (which checks them against the size and SHA-256 the library embeds); encrypted weights
 * need the key and AES-GCM, which this example leaves to cuvil.load(..., verify=, weights_key=).
 *
 * Exit status: 0 verified and ran; 1 refused (unsigned, wrong key, altered/missing/extra file), with the
 * reason; 2 usage or I/O error; 3 the library failed to load or run.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <openssl/evp.h>
#include <openssl/pem.h>

#if OPENSSL_VERSION_NUMBER < 0x30000000L   /* OpenSSL 1.1.1: the same calls under their older names */
#define EVP_PKEY_get_base_id EVP_PKEY_base_id
#define EVP_PKEY_get_bits EVP_PKEY_bits
#endif

#define REFUSE(...) do { fprintf(stderr, "refused: " __VA_ARGS__); fputc('\n', stderr); exit(1); } while (0)
#define FAIL(...) do { fprintf(stderr, "error: " __VA_ARGS__); fputc('\n', stderr); exit(2); } while (0)

/* ---- files ------------------------------------------------------------------------------------------------ */

typedef struct { unsigned char *data; size_t len; } buf;

/* The whole file, or .data == NULL if it does not exist (any other failure exits). A regular file only: a
 * symbolic link is not followed, and a FIFO is refused, not waited on (O_NONBLOCK until fstat says what it is). */
static buf read_file(const char *path) {
    buf b = {NULL, 0};
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0) {
        if (errno == ENOENT) return b;
        if (errno == ELOOP) REFUSE("%s is a symbolic link; a signed artifact holds plain files only", path);
        if (errno == ENXIO) REFUSE("%s is not a regular file", path);
        FAIL("%s: %s", path, strerror(errno));
    }
    struct stat st;
    if (fstat(fd, &st) || !S_ISREG(st.st_mode)) REFUSE("%s is not a regular file", path);
    if (fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK)) FAIL("%s: %s", path, strerror(errno));
    size_t cap = 1 << 16;
    b.data = malloc(cap);
    for (;;) {
        if (!b.data) FAIL("out of memory reading %s", path);
        ssize_t n = read(fd, b.data + b.len, cap - b.len);
        if (n < 0) FAIL("%s: %s", path, strerror(errno));
        if (n == 0) break;
        b.len += (size_t)n;
        if (b.len == cap) b.data = realloc(b.data, cap *= 2);
    }
    close(fd);
    return b;
}

/* ---- a small JSON reader: enough for a Sigstore bundle and an in-toto statement ----------------------------- */

typedef enum { J_NULL, J_BOOL, J_NUM, J_STR, J_ARR, J_OBJ } jtype;
typedef struct jval {
    jtype t;
    char *s;                 /* J_STR: the decoded string (NUL-terminated; a NUL inside is refused) */
    size_t n;                /* J_ARR / J_OBJ: element count */
    char **keys;             /* J_OBJ */
    struct jval **items;     /* J_ARR / J_OBJ */
} jval;

typedef struct { const char *p, *end; int depth; } jparser;

static void jskip(jparser *q) { while (q->p < q->end && (*q->p == ' ' || *q->p == '\n' || *q->p == '\r' || *q->p == '\t')) q->p++; }

static jval *jparse(jparser *q);

static char *jstring(jparser *q) {
    if (q->p >= q->end || *q->p != '"') return NULL;
    q->p++;
    size_t cap = 64, len = 0;
    char *out = malloc(cap);
    while (out && q->p < q->end && *q->p != '"') {
        if (len + 8 >= cap) { char *o = realloc(out, cap *= 2); if (!o) { free(out); return NULL; } out = o; }
        unsigned char c = (unsigned char)*q->p++;
        if (c < 0x20) { free(out); return NULL; }
        if (c != '\\') { out[len++] = (char)c; continue; }
        if (q->p >= q->end) break;
        char e = *q->p++;
        switch (e) {
        case '"': case '\\': case '/': out[len++] = e; break;
        case 'b': out[len++] = '\b'; break;
        case 'f': out[len++] = '\f'; break;
        case 'n': out[len++] = '\n'; break;
        case 'r': out[len++] = '\r'; break;
        case 't': out[len++] = '\t'; break;
        case 'u': {
            unsigned cp = 0;
            if (q->end - q->p < 4) { free(out); return NULL; }
            for (int k = 0; k < 4; k++) {
                char h = *q->p++;
                cp = cp * 16 + (unsigned)(h >= '0' && h <= '9' ? h - '0' : h >= 'a' && h <= 'f' ? h - 'a' + 10 :
                                          h >= 'A' && h <= 'F' ? h - 'A' + 10 : 99);
                if (cp > 0xFFFF) { free(out); return NULL; }
            }
            if (cp == 0 || (cp >= 0xD800 && cp <= 0xDFFF)) { free(out); return NULL; }  /* not in our files */
            if (cp < 0x80) out[len++] = (char)cp;
            else if (cp < 0x800) { out[len++] = (char)(0xC0 | cp >> 6); out[len++] = (char)(0x80 | (cp & 0x3F)); }
            else { out[len++] = (char)(0xE0 | cp >> 12); out[len++] = (char)(0x80 | ((cp >> 6) & 0x3F));
                   out[len++] = (char)(0x80 | (cp & 0x3F)); }
            break;
        }
        default: free(out); return NULL;
        }
    }
    if (!out || q->p >= q->end) { free(out); return NULL; }
    q->p++;
    out[len] = 0;
    return out;
}

static jval *jnew(jtype t) { jval *v = calloc(1, sizeof *v); if (v) v->t = t; return v; }

static jval *jparse(jparser *q) {
    jskip(q);
    if (q->p >= q->end || ++q->depth > 64) return NULL;
    jval *v = NULL;
    char c = *q->p;
    if (c == '"') {
        char *s = jstring(q);
        if (s && (v = jnew(J_STR))) v->s = s; else free(s);
    } else if (c == '{' || c == '[') {
        int obj = c == '{';
        q->p++;
        v = jnew(obj ? J_OBJ : J_ARR);
        size_t cap = 0;
        jskip(q);
        if (v && q->p < q->end && *q->p == (obj ? '}' : ']')) { q->p++; q->depth--; return v; }
        while (v) {
            char *key = NULL;
            if (obj) {
                jskip(q);
                key = jstring(q);
                jskip(q);
                if (!key || q->p >= q->end || *q->p++ != ':') { free(key); return NULL; }
            }
            jval *item = jparse(q);
            if (!item) { free(key); return NULL; }
            if (v->n == cap) {
                cap = cap ? 2 * cap : 8;
                v->items = realloc(v->items, cap * sizeof *v->items);
                if (obj) v->keys = realloc(v->keys, cap * sizeof *v->keys);
                if (!v->items || (obj && !v->keys)) return NULL;
            }
            if (obj) v->keys[v->n] = key;
            v->items[v->n++] = item;
            jskip(q);
            if (q->p < q->end && *q->p == ',') { q->p++; continue; }
            if (q->p < q->end && *q->p == (obj ? '}' : ']')) { q->p++; break; }
            return NULL;
        }
    } else {
        const char *s = q->p;
        while (q->p < q->end && strchr("0123456789+-.eEtruefalsn", *q->p)) q->p++;
        size_t n = (size_t)(q->p - s);
        if (n == 4 && !memcmp(s, "true", 4)) v = jnew(J_BOOL);
        else if (n == 5 && !memcmp(s, "false", 5)) v = jnew(J_BOOL);
        else if (n == 4 && !memcmp(s, "null", 4)) v = jnew(J_NULL);
        else if (n > 0 && (s[0] == '-' || (s[0] >= '0' && s[0] <= '9'))) v = jnew(J_NUM);
    }
    q->depth--;
    return v;
}

static jval *jload(const unsigned char *text, size_t len) {
    jparser q = {(const char *)text, (const char *)text + len, 0};
    jval *v = jparse(&q);
    jskip(&q);
    return q.p == q.end ? v : NULL;
}

static jval *jget(const jval *o, const char *key) {
    if (!o || o->t != J_OBJ) return NULL;
    for (size_t k = 0; k < o->n; k++) if (!strcmp(o->keys[k], key)) return o->items[k];
    return NULL;
}

static const char *jstr(const jval *o, const char *key) {
    const jval *v = jget(o, key);
    return v && v->t == J_STR ? v->s : NULL;
}

/* ---- crypto ------------------------------------------------------------------------------------------------ */

static buf base64_decode(const char *text) {
    size_t n = strlen(text);
    buf b = {malloc(n / 4 * 3 + 3), 0};
    if (!b.data || n % 4) { free(b.data); b.data = NULL; return b; }
    int got = EVP_DecodeBlock(b.data, (const unsigned char *)text, (int)n);
    if (got < 0) { free(b.data); b.data = NULL; return b; }
    b.len = (size_t)got - (n && text[n - 1] == '=') - (n > 1 && text[n - 2] == '=');
    return b;
}

static void sha256_hex(const unsigned char *data, size_t len, char hex[65], unsigned char raw[32]) {
    unsigned char d[32];
    unsigned int dl = 0;
    if (!EVP_Digest(data, len, d, &dl, EVP_sha256(), NULL) || dl != 32) FAIL("SHA-256 failed");
    for (int k = 0; k < 32; k++) sprintf(hex + 2 * k, "%02x", d[k]);
    if (raw) memcpy(raw, d, 32);
}

/* 1 when sig (DER ECDSA) holds over msg with the PEM public key in pub_path. */
static int ecdsa_verify(const char *pub_path, const unsigned char *msg, size_t msg_len, const buf *sig) {
    FILE *f = fopen(pub_path, "r");
    if (!f) FAIL("%s: %s", pub_path, strerror(errno));
    EVP_PKEY *key = PEM_read_PUBKEY(f, NULL, NULL, NULL);
    fclose(f);
    if (!key) FAIL("%s: not a PEM public key (cuvil keygen --public writes one)", pub_path);
    if (EVP_PKEY_get_base_id(key) != EVP_PKEY_EC) FAIL("%s: not an EC public key", pub_path);
    int bits = EVP_PKEY_get_bits(key);
    const EVP_MD *md = bits <= 256 ? EVP_sha256() : bits <= 384 ? EVP_sha384() : EVP_sha512();
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    int ok = ctx && EVP_DigestVerifyInit(ctx, NULL, md, NULL, key) == 1 &&
             EVP_DigestVerify(ctx, sig->data, sig->len, msg, msg_len) == 1;
    EVP_MD_CTX_free(ctx);
    EVP_PKEY_free(key);
    return ok;
}

/* ---- verification ------------------------------------------------------------------------------------------ */

static const char *SIDECARS[] = {".h", ".manifest.json", ".cdx.json", ".intoto.json", ".weights"};

/* Verifies lib_path against its .sig with pub_path; returns the library's verified bytes, and in *weights those
 * of libNAME.weights when it is signed (else .data NULL). */
static buf verify_library(const char *pub_path, const char *lib_path, buf *weights) {
    size_t lp = strlen(lib_path);
    if (lp < 4 || strcmp(lib_path + lp - 3, ".so")) FAIL("%s: expected a libNAME.so", lib_path);
    char base[4096], dir[4096], path[4096];
    if (lp >= sizeof base) FAIL("path too long");
    memcpy(base, lib_path, lp - 3); base[lp - 3] = 0;                      /* build/libmodel */
    const char *slash = strrchr(lib_path, '/');
    const char *lib_name = slash ? slash + 1 : lib_path;
    snprintf(dir, sizeof dir, "%.*s", slash ? (int)(slash - lib_path) : 1, slash ? lib_path : ".");

    if (snprintf(path, sizeof path, "%s.sig", base) >= (int)sizeof path) FAIL("path too long");
    buf sigfile = read_file(path);
    if (!sigfile.data) REFUSE("%s: unsigned (no signature %s); next: cuvil sign %s --key KEY.pem", lib_path, path, lib_path);
    jval *bundle = jload(sigfile.data, sigfile.len);
    jval *env = jget(bundle, "dsseEnvelope");
    const char *media = jstr(bundle, "mediaType"), *ptype = jstr(env, "payloadType"), *payload64 = jstr(env, "payload");
    jval *sigs = jget(env, "signatures");
    const char *sig64 = sigs && sigs->t == J_ARR && sigs->n ? jstr(sigs->items[0], "sig") : NULL;
    if (!media || strcmp(media, "application/vnd.dev.sigstore.bundle.v0.3+json") || !ptype ||
        strcmp(ptype, "application/vnd.in-toto+json") || !payload64 || !sig64)
        REFUSE("%s: not a model-signing signature (Sigstore bundle v0.3 with an in-toto DSSE envelope)", path);

    /* 1. the signature over PAE(payloadType, payload) */
    buf payload = base64_decode(payload64), sig = base64_decode(sig64);
    if (!payload.data || !sig.data) REFUSE("%s: bad base64 in the DSSE envelope", path);
    char head[128];
    int hl = snprintf(head, sizeof head, "DSSEv1 %zu %s %zu ", strlen(ptype), ptype, payload.len);
    unsigned char *pae = malloc((size_t)hl + payload.len);
    if (!pae) FAIL("out of memory");
    memcpy(pae, head, (size_t)hl);
    memcpy(pae + hl, payload.data, payload.len);
    if (!ecdsa_verify(pub_path, pae, (size_t)hl + payload.len, &sig))
        REFUSE("%s: the signature does not verify with %s (another key, or an altered signature)", lib_path, pub_path);

    /* 2. the statement: resources and the subject digest over them */
    jval *st = jload(payload.data, payload.len);
    jval *pred = jget(st, "predicate"), *ser = jget(pred, "serialization"), *res = jget(pred, "resources");
    jval *subj = jget(st, "subject");
    const char *root = subj && subj->t == J_ARR && subj->n == 1 ? jstr(jget(subj->items[0], "digest"), "sha256") : NULL;
    if (!jstr(st, "_type") || strcmp(jstr(st, "_type"), "https://in-toto.io/Statement/v1") ||
        !jstr(st, "predicateType") || strcmp(jstr(st, "predicateType"), "https://model_signing/signature/v1.0") ||
        !jstr(ser, "method") || strcmp(jstr(ser, "method"), "files") || !jstr(ser, "hash_type") ||
        strcmp(jstr(ser, "hash_type"), "sha256") || !res || res->t != J_ARR || !root)
        REFUSE("%s: the signed statement is not a model-signing v1.0 files/sha256 statement", path);
    EVP_MD_CTX *all = EVP_MD_CTX_new();
    EVP_DigestInit_ex(all, EVP_sha256(), NULL);

    /* 3. every signed file, read once, hashed; the library's bytes kept */
    buf lib = {NULL, 0};
    weights->data = NULL;
    for (size_t k = 0; k < res->n; k++) {
        const char *name = jstr(res->items[k], "name"), *alg = jstr(res->items[k], "algorithm");
        const char *want = jstr(res->items[k], "digest");
        if (!name || !alg || strcmp(alg, "sha256") || !want || strlen(want) != 64 || strchr(name, '/') || !strcmp(name, "..") || !*name)
            REFUSE("%s: resource %zu is not a sha256 digest of a file beside the library", path, k);
        if (snprintf(path, sizeof path, "%s/%s", dir, name) >= (int)sizeof path) FAIL("path too long");
        buf f = read_file(path);
        if (!f.data) REFUSE("%s: %s is missing (it was signed)", lib_path, name);
        char hex[65];
        unsigned char raw[32];
        sha256_hex(f.data, f.len, hex, raw);
        if (strcmp(hex, want)) REFUSE("%s: %s was altered after signing", lib_path, name);
        unsigned char wraw[32];
        for (int i = 0; i < 32; i++) { unsigned v; sscanf(want + 2 * i, "%2x", &v); wraw[i] = (unsigned char)v; }
        EVP_DigestUpdate(all, wraw, 32);
        size_t nl = strlen(name), bl = strlen(lib_name) - 3;                 /* libNAME */
        if (!strcmp(name, lib_name)) lib = f;
        else if (nl == bl + 8 && !strncmp(name, lib_name, bl) && !strcmp(name + bl, ".weights")) *weights = f;
        else free(f.data);
    }
    unsigned char rd[32];
    unsigned int rdl = 0;
    EVP_DigestFinal_ex(all, rd, &rdl);
    EVP_MD_CTX_free(all);
    char rhex[65];
    for (int i = 0; i < 32; i++) sprintf(rhex + 2 * i, "%02x", rd[i]);
    if (strcmp(rhex, root)) REFUSE("%s: the subject digest does not match the resources", path);
    if (!lib.data) REFUSE("%s: the signature %s.sig does not cover %s", lib_path, base, lib_name);

    /* a sidecar present but not signed (added after signing) */
    for (size_t s = 0; s < sizeof SIDECARS / sizeof SIDECARS[0]; s++) {
        if (snprintf(path, sizeof path, "%s%s", base, SIDECARS[s]) >= (int)sizeof path) FAIL("path too long");
        if (access(path, F_OK)) continue;
        const char *nm = strrchr(path, '/') ? strrchr(path, '/') + 1 : path;
        int signed_ = 0;
        for (size_t k = 0; k < res->n; k++) signed_ |= !strcmp(jstr(res->items[k], "name"), nm);
        if (!signed_) REFUSE("%s: %s is not covered by the signature (added after signing)", lib_path, nm);
    }
    printf("verified %s: %zu files signed with %s\n", lib_path, res->n, pub_path);
    free(sigfile.data); free(payload.data); free(sig.data); free(pae);
    return lib;   /* the JSON trees are left to the process's end: a one-shot program */
}

/* The verified bytes in a sealed memfd; returns the path dlopen reads it through. */
static void sealed_path(const buf *lib, const char *name, char *out, size_t cap) {
    int fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0) FAIL("memfd_create: %s", strerror(errno));
    for (size_t off = 0; off < lib->len;) {
        ssize_t n = write(fd, lib->data + off, lib->len - off);
        if (n <= 0) FAIL("memfd write: %s", strerror(errno));
        off += (size_t)n;
    }
    if (fcntl(fd, F_ADD_SEALS, F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0)
        FAIL("sealing the memfd: %s", strerror(errno));
    snprintf(out, cap, "/proc/self/fd/%d", fd);   /* kept open: the library stays mapped from it */
}

/* ---- running ----------------------------------------------------------------------------------------------- */

static void *sym(void *h, const char *prefix, const char *name);

/* A library compiled with --external-weights: hand it the payload of the verified weights file (header: "CUVILWTS",
 * u32 version, u32 flags (1 = encrypted), u64 header_bytes, u64 plain_bytes; docs/weights.md), copied to a
 * page-aligned buffer that lives as long as the process. Exits 3 if the library cannot use them. */
static void bind_verified_weights(void *h, const char *prefix, const buf *w) {
    char full[256];
    snprintf(full, sizeof full, "%s_weights_info", prefix);
    int (*info)(int64_t *, uint8_t *) = (int (*)(int64_t *, uint8_t *))dlsym(h, full);
    int64_t nbytes = 0;
    int external = info && info(&nbytes, NULL) == 1;
    if (!external) {
        if (w->data) { fprintf(stderr, "error: a weights file is signed but the library embeds its weights\n"); exit(3); }
        return;
    }
    if (!w->data) { fprintf(stderr, "error: the library needs external weights, and none are signed with it\n"); exit(3); }
    uint32_t version, flags;
    uint64_t header_bytes, plain_bytes;
    if (w->len < 40 || memcmp(w->data, "CUVILWTS", 8)) { fprintf(stderr, "error: not a Cuvil weights file\n"); exit(3); }
    memcpy(&version, w->data + 8, 4);
    memcpy(&flags, w->data + 12, 4);
    memcpy(&header_bytes, w->data + 16, 8);
    memcpy(&plain_bytes, w->data + 24, 8);
    if (version != 1 || (flags & 1)) {
        fprintf(stderr, "error: %s\n", version != 1 ? "weights format version is not 1"
                                                    : "encrypted weights: load them with cuvil.load(path, verify=PUB, weights_key=KEY)");
        exit(3);
    }
    if (header_bytes > w->len || plain_bytes != w->len - header_bytes) { fprintf(stderr, "error: weights file size\n"); exit(3); }
    void *payload = NULL;
    if (posix_memalign(&payload, 4096, plain_bytes ? plain_bytes : 1)) FAIL("out of memory");
    memcpy(payload, w->data + header_bytes, plain_bytes);
    int (*bind)(const void *, size_t) = (int (*)(const void *, size_t))sym(h, prefix, "bind_weights");
    const char *(*strerror_)(int) = (const char *(*)(int))sym(h, prefix, "strerror");
    int rc = bind(payload, (size_t)plain_bytes);
    if (rc) { fprintf(stderr, "error: bind_weights: %s\n", strerror_(rc)); exit(3); }
}

typedef struct { void *data; int32_t dtype; int32_t ndim; int64_t *shape; } cuvil_tensor;

static void *sym(void *h, const char *prefix, const char *name) {
    char full[256];
    snprintf(full, sizeof full, "%s_%s", prefix, name);
    void *p = dlsym(h, full);
    if (!p) { fprintf(stderr, "error: the library has no %s (compiled with another --prefix? give it as the third "
                              "argument)\n", full); exit(3); }
    return p;
}

static size_t dtype_size(int32_t t) {
    switch (t) { case 2: case 3: case 9: return 1; case 4: case 5: case 10: case 16: return 2;
                 case 1: case 6: case 12: return 4; default: return 8; }
}

int main(int argc, char **argv) {
    if (argc < 3 || argc > 4) FAIL("usage: %s PUB.pem build/libNAME.so [PREFIX]", argv[0]);
    const char *prefix = argc == 4 ? argv[3] : "cuvil";
    buf weights;
    buf lib = verify_library(argv[1], argv[2], &weights);
    char dl_path[64];
    sealed_path(&lib, strrchr(argv[2], '/') ? strrchr(argv[2], '/') + 1 : argv[2], dl_path, sizeof dl_path);
    free(lib.data);
    void *h = dlopen(dl_path, RTLD_NOW | RTLD_LOCAL);
    if (!h) { fprintf(stderr, "error: dlopen: %s\n", dlerror()); return 3; }
    bind_verified_weights(h, prefix, &weights);
    free(weights.data);

    int (*num_inputs)(void) = (int (*)(void))sym(h, prefix, "num_inputs");
    int (*num_outputs)(void) = (int (*)(void))sym(h, prefix, "num_outputs");
    const char *(*output_name)(int) = (const char *(*)(int))sym(h, prefix, "output_name");
    int (*input_info)(int, int32_t *, int32_t *, int64_t *) = (int (*)(int, int32_t *, int32_t *, int64_t *))sym(h, prefix, "input_info");
    void *(*session_create)(int) = (void *(*)(int))sym(h, prefix, "session_create");
    int (*output_shape)(void *, const cuvil_tensor *, int, int64_t *) =
        (int (*)(void *, const cuvil_tensor *, int, int64_t *))sym(h, prefix, "output_shape");
    int (*output_info)(int, int32_t *, int32_t *, int64_t *) = (int (*)(int, int32_t *, int32_t *, int64_t *))sym(h, prefix, "output_info");
    int (*run)(void *, const cuvil_tensor *, cuvil_tensor *) = (int (*)(void *, const cuvil_tensor *, cuvil_tensor *))sym(h, prefix, "run");
    const char *(*strerror_)(int) = (const char *(*)(int))sym(h, prefix, "strerror");
    void (*session_destroy)(void *) = (void (*)(void *))sym(h, prefix, "session_destroy");

    int ni = num_inputs(), no = num_outputs();
    cuvil_tensor *in = calloc((size_t)ni + 1, sizeof *in), *out = calloc((size_t)no + 1, sizeof *out);
    for (int i = 0; i < ni; i++) {
        int32_t dt, nd;
        input_info(i, &dt, &nd, NULL);
        in[i].shape = calloc((size_t)nd + 1, sizeof(int64_t));
        input_info(i, NULL, NULL, in[i].shape);
        size_t count = 1;
        for (int d = 0; d < nd; d++) { if (in[i].shape[d] < 0) in[i].shape[d] = 1; count *= (size_t)in[i].shape[d]; }
        in[i].dtype = dt; in[i].ndim = nd;
        in[i].data = calloc(count + 1, dtype_size(dt));
        if (dt == 1) for (size_t k = 0; k < count; k++) ((float *)in[i].data)[k] = 0.1f * (float)(k % 7) - 0.3f;
    }
    void *s = session_create(0);
    if (!s) { fprintf(stderr, "error: session_create failed\n"); return 3; }
    for (int j = 0; j < no; j++) {
        int32_t dt, nd;
        output_info(j, &dt, &nd, NULL);
        out[j].shape = calloc((size_t)nd + 1, sizeof(int64_t));
        int rc = output_shape(s, in, j, out[j].shape);
        if (rc) { fprintf(stderr, "error: %s\n", strerror_(rc)); return 3; }
        size_t count = 1;
        for (int d = 0; d < nd; d++) count *= (size_t)out[j].shape[d];
        out[j].dtype = dt; out[j].ndim = nd;
        out[j].data = calloc(count + 1, dtype_size(dt));
    }
    int rc = run(s, in, out);
    if (rc) { fprintf(stderr, "error: run: %s\n", strerror_(rc)); return 3; }
    for (int j = 0; j < no; j++) {
        size_t count = 1;
        printf("%s shape [", output_name(j));
        for (int d = 0; d < out[j].ndim; d++) { printf(d ? ",%lld" : "%lld", (long long)out[j].shape[d]); count *= (size_t)out[j].shape[d]; }
        printf("]");
        if (out[j].dtype == 1) {
            printf(" values");
            for (size_t k = 0; k < count && k < 10; k++) printf(" %.6g", ((float *)out[j].data)[k]);
        }
        printf("\n");
    }
    session_destroy(s);
    return 0;
}
