/* The compiled tar walk: a WebDataset shard's sample index from its bytes as a copy passes
 * them, with no Python per member and without the interpreter lock.
 *
 * Why C: a shard of 25,000 ~1 KB samples has 50,000 members. Walked in Python (~10 us a
 * header) or scanned with numpy (~36 ms per 77 MB shard: every candidate header copied out,
 * checked and split as arrays) indexing cost as much as copying the shard. Here a header costs
 * tens of nanoseconds, the bytes are looked at while the copy has them in the CPU cache, and
 * the lock is released while they are, so copies on other threads go on.
 *
 * What it vouches for is what the small-shard walk (stager/shards/tarwalk.py) vouches for,
 * checked the same way, plus long names: the "ustar" magic; every numeric field in a form
 * tarfile reads (octal digits between spaces and up to a NUL, base-256 where tarfile allows
 * it); the checksum as unsigned or signed bytes; regular files, directories, links and
 * devices; PAX records that leave the size alone (webdataset writes one before every member),
 * their "path" taken as tarfile takes it (trailing slashes stripped); GNU long names ("L", up
 * to the first NUL of the padded payload) and long link names ("K", not read). In a run of
 * such headers the first that names the member wins, as tarfile patches it last. Names must
 * be printable ASCII, and without a long name there must be no ustar prefix. It follows the
 * sizes from byte 0 as tarfile does, so a tar stored inside a payload is never seen, and the
 * archive must end on a zero block. Anything else (global PAX headers, sparse files, a PAX
 * "size", "hdrcharset", damage, a truncated copy) makes finish() return None, and the caller
 * asks the slower indexers, which accept exactly what tarfile accepts. It never decides that
 * a shard is bad.
 *
 * Members are grouped into samples as webdataset groups them (consecutive members with the
 * same key; the key is the name up to the first dot of its last path component), and a member
 * named twice in one sample is reported, as stager.shards.members.SampleGrouper does.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "_tarwalk_api.h"

#define BLOCK 512
/* A PAX header larger than this is left to the slower indexers (it is held whole). */
#define MAX_PAX_BYTES (1u << 20)
/* Distinct extensions per shard; past this the numpy scanner decides (codes are int16). */
#define MAX_EXTS 32767

enum { RUNNING = 0, ENDED = 1, FAILED = -1 };
enum { NEED_MORE = 1, TOOK = 0 };

typedef struct {
    int64_t offset;
    int64_t size;
    int16_t ext;
} Member;

typedef struct {
    uint32_t at; /* in the name arena */
    uint32_t len;
} Span;

typedef struct {
    PyObject_HEAD
    uint64_t fed;  /* bytes fed so far */
    uint64_t next; /* where the next header starts */
    int state;
    int after_meta; /* the last header was metadata (PAX, L, K): another header must follow */
    /* the name a GNU long name or a PAX path gives the next member (the first in a run wins) */
    unsigned char *rename;
    size_t rename_len, rename_cap;
    int renamed;
    int busy;       /* a feed is running (without the lock) */
    /* a record (a header, or a PAX header with its records) split between two chunks */
    unsigned char *hold;
    size_t hold_len, hold_cap, want;
    /* the index */
    Member *members;
    size_t n_members, cap_members;
    int64_t *sample_start; /* first member of each sample */
    Span *keys;
    size_t n_samples, cap_samples;
    size_t key_width;
    char *arena; /* key and extension bytes */
    size_t arena_len, arena_cap;
    Span *exts; /* distinct extensions, by code */
    size_t n_exts, cap_exts;
    int32_t *ext_table; /* open addressing: code + 1, 0 = empty */
    size_t table_cap;
    int64_t duplicate; /* the first member named twice in its sample, or -1 */
    size_t duplicate_sample; /* the sample it belongs to */
    int out_of_memory;
} Walker;

static int grow(void **buf, size_t *cap, size_t need, size_t item) {
    if (need <= *cap) return 1;
    size_t n = *cap ? *cap : 64;
    while (n < need) n *= 2;
    void *p = realloc(*buf, n * item);
    if (!p) return 0;
    *buf = p;
    *cap = n;
    return 1;
}

/* tarfile's nti() for the forms every reader agrees on: octal digits, possibly between
 * spaces, up to the first NUL; base-256 (0x80 or 0xff first) where `base256` allows it. */
static int read_number(const unsigned char *field, int len, int base256, uint64_t *value) {
    if (field[0] == 0x80 || field[0] == 0xff) {
        *value = 0;
        return base256;
    }
    int end = 0;
    while (end < len && field[end]) end++;
    int a = 0, b = end;
    while (a < b && field[a] == ' ') a++;
    while (b > a && field[b - 1] == ' ') b--;
    uint64_t v = 0;
    for (int i = a; i < b; i++) {
        if (field[i] < '0' || field[i] > '7') return 0;
        v = v * 8 + (uint64_t)(field[i] - '0');
    }
    *value = v;
    return 1;
}

/* tarfile's check: the stored checksum is the sum of the header's bytes, its own field counted
 * as eight spaces, read as unsigned or as signed chars (signed = unsigned - 256 x the bytes
 * >= 0x80). A byte loop cost more than the rest of the walk: SSE2 (every x86-64) sums 16
 * bytes an instruction; elsewhere eight bytes at a time in 16-bit lanes. */
static void byte_sums(const unsigned char *h, int64_t *sum, int64_t *highs) {
#if defined(__SSE2__)
    __m128i zero = _mm_setzero_si128(), one = _mm_set1_epi8(1), total = zero, high = zero;
    for (int i = 0; i < BLOCK; i += 16) {
        __m128i x = _mm_loadu_si128((const __m128i *)(h + i));
        total = _mm_add_epi64(total, _mm_sad_epu8(x, zero));
        high = _mm_add_epi64(high, _mm_sad_epu8(_mm_and_si128(_mm_srli_epi16(x, 7), one), zero));
    }
    *sum = _mm_cvtsi128_si64(total) + _mm_cvtsi128_si64(_mm_unpackhi_epi64(total, total));
    *highs = _mm_cvtsi128_si64(high) + _mm_cvtsi128_si64(_mm_unpackhi_epi64(high, high));
#else
    const uint64_t low = 0x00FF00FF00FF00FFULL, ones = 0x0101010101010101ULL;
    uint64_t lanes = 0, high = 0; /* 64 words of two bytes <= 255 stay under 65,536 a lane */
    for (int i = 0; i < BLOCK; i += 8) {
        uint64_t word;
        memcpy(&word, h + i, 8);
        lanes += (word & low) + ((word >> 8) & low);
        high += (word >> 7) & ones; /* at most 64 per byte lane */
    }
    high = (high & low) + ((high >> 8) & low);
    *sum = *highs = 0;
    for (int lane = 0; lane < 64; lane += 16) {
        *sum += (int64_t)((lanes >> lane) & 0xFFFF);
        *highs += (int64_t)((high >> lane) & 0xFFFF);
    }
#endif
}

static int checksum_ok(const unsigned char *h, uint64_t stored) {
    int64_t sum, highs;
    byte_sums(h, &sum, &highs);
    for (int i = 148; i < 156; i++) { /* the field itself counts as spaces */
        sum -= h[i];
        highs -= h[i] >> 7;
    }
    int64_t unsigned_sum = sum + 8 * ' ';
    int64_t signed_sum = unsigned_sum - 256 * highs;
    return (uint64_t)unsigned_sum == stored || (signed_sum >= 0 && (uint64_t)signed_sum == stored);
}

/* Whether the eight bytes at `p` are seven octal digits then a NUL or a space (the form
 * tarfile and GNU tar write), or start with a NUL (an empty field): then read_number would
 * accept them, and the walk needs no value from them. */
static int usual_field(const unsigned char *p) {
    uint64_t word;
    memcpy(&word, p, 8);
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    unsigned char last = (unsigned char)(word >> 56);
    return p[0] == 0 || ((word & 0x00F8F8F8F8F8F8F8ULL) == 0x0030303030303030ULL &&
                         (last == 0 || last == ' '));
#else
    (void)word;
    return p[0] == 0;
#endif
}

static int is_zero_block(const unsigned char *h) {
    for (int i = 0; i < BLOCK; i++)
        if (h[i]) return 0;
    return 1;
}

/* Whether a PAX header's records are well formed and leave the next member's size alone
 * (stager.shards.tarheader.padded_pax_records): "%d %s=%s\n" records ending exactly at `size`,
 * nothing but a NUL after them in the block's padding, where tarfile would go on parsing, no
 * "size" or "GNU.sparse.*" record. `*path` is set to the value of the last "path" record. */
static int pax_check(const unsigned char *p, size_t size, size_t padded,
                     const unsigned char **path, size_t *path_len) {
    *path = NULL;
    *path_len = 0;
    if (padded > size && p[size] != 0) return 0;
    /* tarfile searches the whole padded payload for "hdrcharset=" and decodes what follows as
     * strict UTF-8, raising on anything else: left to it wherever it appears */
    static const char charset[] = "hdrcharset=";
    size_t charset_len = sizeof charset - 1;
    for (const unsigned char *at = p; (size_t)(p + padded - at) >= charset_len; at++) {
        at = memchr(at, 'h', (size_t)(p + padded - at) - charset_len + 1);
        if (!at) break;
        if (!memcmp(at, charset, charset_len)) return 0;
    }
    size_t pos = 0;
    while (pos < size) {
        size_t space = pos;
        size_t limit = pos + 21 < size ? pos + 21 : size;
        while (space < limit && p[space] != ' ') space++;
        if (space >= limit || space == pos) return 0;
        uint64_t length = 0;
        for (size_t i = pos; i < space; i++) {
            if (p[i] < '0' || p[i] > '9') return 0;
            length = length * 10 + (uint64_t)(p[i] - '0');
            if (length > size) return 0;
        }
        size_t end = pos + (size_t)length;
        if (end <= space + 1 || end > size || p[end - 1] != '\n') return 0;
        const unsigned char *key = p + space + 1;
        const unsigned char *eq = memchr(key, '=', (size_t)(p + end - 1 - key));
        if (!eq || eq == key) return 0;
        size_t key_len = (size_t)(eq - key);
        if ((key_len == 4 && !memcmp(key, "size", 4)) ||
            (key_len >= 11 && !memcmp(key, "GNU.sparse.", 11)))
            return 0;
        if (key_len == 4 && !memcmp(key, "path", 4)) { /* the last one wins, as in tarfile */
            *path = eq + 1;
            *path_len = (size_t)(p + end - 1 - (eq + 1));
        }
        pos = end;
    }
    return 1;
}

static uint64_t hash_bytes(const char *s, size_t n) {
    uint64_t h = 1469598103934665603ULL;
    for (size_t i = 0; i < n; i++) h = (h ^ (unsigned char)s[i]) * 1099511628211ULL;
    return h;
}

static int arena_add(Walker *w, const char *s, size_t n, Span *span) {
    if (!grow((void **)&w->arena, &w->arena_cap, w->arena_len + n, 1)) return 0;
    if (n) memcpy(w->arena + w->arena_len, s, n); /* (an empty extension: arena may be NULL) */
    span->at = (uint32_t)w->arena_len;
    span->len = (uint32_t)n;
    w->arena_len += n;
    return w->arena_len < UINT32_MAX;
}

/* The code of extension `s`, added when new; -1 when out of memory, -2 past MAX_EXTS. */
static int ext_code(Walker *w, const char *s, size_t n) {
    if (w->n_exts * 2 >= w->table_cap) {
        size_t cap = w->table_cap ? w->table_cap * 2 : 64;
        int32_t *table = calloc(cap, sizeof(int32_t));
        if (!table) return -1;
        for (size_t c = 0; c < w->n_exts; c++) {
            size_t slot = hash_bytes(w->arena + w->exts[c].at, w->exts[c].len) & (cap - 1);
            while (table[slot]) slot = (slot + 1) & (cap - 1);
            table[slot] = (int32_t)c + 1;
        }
        free(w->ext_table);
        w->ext_table = table;
        w->table_cap = cap;
    }
    size_t slot = hash_bytes(s, n) & (w->table_cap - 1);
    while (w->ext_table[slot]) {
        Span *e = &w->exts[w->ext_table[slot] - 1];
        if (e->len == n && !memcmp(w->arena + e->at, s, n)) return w->ext_table[slot] - 1;
        slot = (slot + 1) & (w->table_cap - 1);
    }
    if (w->n_exts >= MAX_EXTS) return -2;
    if (!grow((void **)&w->exts, &w->cap_exts, w->n_exts + 1, sizeof(Span))) return -1;
    if (!arena_add(w, s, n, &w->exts[w->n_exts])) return -1;
    w->ext_table[slot] = (int32_t)w->n_exts + 1;
    return (int)w->n_exts++;
}

/* ext_code of the extension lower-cased (ASCII; the walk vouches only for ASCII names), as
 * stager.shards.members.split_key and webdataset's grouping lower-case it. */
static int lowered_ext_code(Walker *w, const char *s, size_t n) {
    size_t upper = 0;
    while (upper < n && !(s[upper] >= 'A' && s[upper] <= 'Z')) upper++;
    if (upper == n) return ext_code(w, s, n); /* nearly always: nothing to lower */
    char small[64];
    char *low = n <= sizeof small ? small : malloc(n);
    if (!low) return -1;
    for (size_t i = 0; i < n; i++)
        low[i] = (char)((s[i] >= 'A' && s[i] <= 'Z') ? s[i] - 'A' + 'a' : s[i]);
    int code = ext_code(w, low, n);
    if (low != small) free(low);
    return code;
}

static int grow_samples(Walker *w) {
    if (w->n_samples < w->cap_samples) return 1;
    size_t cap = w->cap_samples ? w->cap_samples * 2 : 64;
    Span *keys = realloc(w->keys, cap * sizeof(Span));
    if (!keys) return 0;
    w->keys = keys;
    int64_t *starts = realloc(w->sample_start, cap * sizeof(int64_t));
    if (!starts) return 0;
    w->sample_start = starts;
    w->cap_samples = cap;
    return 1;
}

/* A file member: grouped into its sample when its name has a key and an extension (names
 * without one are not sample members, as in webdataset). 1 when taken, 0 when the walk
 * does not vouch (too many distinct extensions), -1 when out of memory. */
static int add_member(Walker *w, const unsigned char *name, size_t len, int64_t offset,
                      int64_t size) {
    size_t base = 0;
    for (size_t i = len; i > 0; i--)
        if (name[i - 1] == '/') {
            base = i;
            break;
        }
    const unsigned char *dot = memchr(name + base, '.', len - base);
    if (!dot || dot == name + base) return 1; /* no extension, or a hidden file: skipped */
    size_t key_len = (size_t)(dot - name);
    const char *ext = (const char *)dot + 1;
    size_t ext_len = len - key_len - 1;
    int code = lowered_ext_code(w, ext, ext_len);
    if (code < 0) return code == -2 ? 0 : -1;
    int new_sample = 1;
    if (w->n_samples) {
        Span *last = &w->keys[w->n_samples - 1];
        new_sample = !(last->len == key_len && !memcmp(w->arena + last->at, name, key_len));
    }
    if (new_sample) {
        if (!grow_samples(w)) return -1;
        if (!arena_add(w, (const char *)name, key_len, &w->keys[w->n_samples])) return -1;
        w->sample_start[w->n_samples] = (int64_t)w->n_members;
        w->n_samples++;
        if (key_len > w->key_width) w->key_width = key_len;
    } else if (w->duplicate < 0) {
        for (size_t m = (size_t)w->sample_start[w->n_samples - 1]; m < w->n_members; m++)
            if (w->members[m].ext == code) {
                w->duplicate = (int64_t)w->n_members;
                w->duplicate_sample = w->n_samples - 1;
                break;
            }
    }
    if (!grow((void **)&w->members, &w->cap_members, w->n_members + 1, sizeof(Member)))
        return -1;
    Member *m = &w->members[w->n_members++];
    m->offset = offset;
    m->size = size;
    m->ext = (int16_t)code;
    return 1;
}

static uint64_t padded_size(uint64_t size) { return (size + BLOCK - 1) / BLOCK * BLOCK; }

/* Ask the memory for the next headers while this one is checked. Why: a shard's headers lie a
 * member apart, too far apart for the CPU's own prefetcher, and each one's place is known only
 * from the one before (a chain of loads). Walking a 77 MB shard of ~1 KB samples from memory
 * (an index built from a mapped staged shard) cost ~650 ns a member, against ~85 ns with the
 * bytes in the cache. Asked for here: the next header's eight cache lines, and where members
 * are small (the next header within 2 KiB), every line of the 2 KiB after it, where the
 * following headers then most probably lie: ~250 ns a member (benchmarks/bench_walk.py).
 * A hint to the CPU: it changes no result and never reads past `avail`. */
static void prefetch_ahead(const unsigned char *rec, size_t avail, uint64_t next) {
#if defined(__GNUC__)
    if (next + BLOCK > avail) return;
    for (int i = 0; i < BLOCK; i += 64) __builtin_prefetch(rec + next + i, 0, 3);
    if (next > 4 * BLOCK) return;
    uint64_t end = next + 5 * BLOCK < avail ? next + 5 * BLOCK : avail;
    for (uint64_t at = next + BLOCK; at + 64 <= end; at += 64) __builtin_prefetch(rec + at, 0, 3);
#else
    (void)rec, (void)avail, (void)next;
#endif
}

/* Read the record (header, and for a PAX header its records) that starts at w->next, from
 * `avail` bytes at `rec`. Returns NEED_MORE with *need set when the record is longer, else
 * TOOK with w->next and w->state updated. */
static int take_record(Walker *w, const unsigned char *rec, size_t avail, size_t *need) {
    if (avail < BLOCK) {
        *need = BLOCK;
        return NEED_MORE;
    }
    if (is_zero_block(rec)) {
        w->state = w->after_meta ? FAILED : ENDED; /* tarfile raises on metadata at the end */
        return TOOK;
    }
    if (memcmp(rec + 257, "ustar", 5) != 0) goto fail;
    static const int fields[][3] = {/* offset, length, base-256 allowed */
                                    {100, 8, 1}, {108, 8, 1}, {116, 8, 1}, {136, 12, 1},
                                    {329, 8, 1}, {337, 8, 1}};
    uint64_t value, size, stored;
    for (size_t i = 0; i < sizeof fields / sizeof fields[0]; i++) {
        const unsigned char *field = rec + fields[i][0];
        if (fields[i][1] == 8 && usual_field(field)) continue; /* valid; its value unused */
        if (!read_number(field, fields[i][1], fields[i][2], &value)) goto fail;
    }
    if (!read_number(rec + 124, 12, 0, &size) || !read_number(rec + 148, 8, 0, &stored))
        goto fail;
    prefetch_ahead(rec, avail, BLOCK + padded_size(size));
    if (!checksum_ok(rec, stored)) goto fail;
    unsigned char kind = rec[156];
    uint64_t payload = 0;
    int meta = 0;
    if (kind == '0' || kind == 0 || kind == '7') {
        size_t len = 0;
        while (len < 100 && rec[len]) len++;
        int renamed = w->renamed;
        w->renamed = 0; /* a long name or PAX path applies to this member only */
        if (kind == 0 && len && rec[len - 1] == '/') {
            /* tarfile reads it as a directory (by its own name field): no payload follows */
        } else {
            const unsigned char *name = rec;
            if (renamed) {
                name = w->rename;
                len = w->rename_len;
            } else if (rec[345]) {
                goto fail; /* a ustar prefix: left to the scanner */
            }
            for (size_t i = 0; i < len; i++)
                if (name[i] < 0x20 || name[i] > 0x7e) goto fail; /* not printable ASCII */
            payload = size;
            int added = add_member(w, name, len, (int64_t)(w->next + BLOCK), (int64_t)size);
            if (added <= 0) {
                w->out_of_memory = added < 0;
                goto fail;
            }
        }
    } else if (kind == 'x' || kind == 'X' || kind == 'L') {
        if (size > MAX_PAX_BYTES) goto fail;
        size_t padded = (size_t)padded_size(size);
        if (avail < BLOCK + padded) {
            *need = BLOCK + padded;
            return NEED_MORE;
        }
        const unsigned char *name;
        size_t len;
        if (kind == 'L') { /* tarfile's nts(): up to the first NUL of the padded payload */
            name = rec + BLOCK;
            const unsigned char *nul = memchr(name, 0, padded);
            len = nul ? (size_t)(nul - name) : padded;
        } else {
            if (!pax_check(rec + BLOCK, (size_t)size, padded, &name, &len)) goto fail;
            while (name && len && name[len - 1] == '/') len--; /* tarfile strips a path's '/' */
        }
        if (name && !w->renamed) { /* the first in a run wins: tarfile patches it last */
            if (!grow((void **)&w->rename, &w->rename_cap, len ? len : 1, 1)) {
                w->out_of_memory = 1;
                goto fail;
            }
            if (len) memcpy(w->rename, name, len);
            w->rename_len = len;
            w->renamed = 1;
        }
        payload = size;
        meta = 1;
    } else if (kind == 'K') { /* a GNU long link name: sets the link target, no name */
        payload = size;
        meta = 1;
    } else if (kind >= '1' && kind <= '6') {
        w->renamed = 0; /* links, devices, directories, FIFOs: the name was theirs */
    } else {
        goto fail; /* global PAX headers, sparse files, unknown types */
    }
    w->after_meta = meta;
    w->next += BLOCK + padded_size(payload);
    return TOOK;
fail:
    w->state = FAILED;
    return TOOK;
}

static int hold_bytes(Walker *w, const unsigned char *p, size_t n) {
    if (!grow((void **)&w->hold, &w->hold_cap, w->hold_len + n, 1)) return 0;
    memcpy(w->hold + w->hold_len, p, n);
    w->hold_len += n;
    return 1;
}

/* After the end-of-archive block every byte must be zero (the rest of the record). Anything
 * else may be a second tar after the first (`cat a.tar b.tar`), or a header zeroed in the
 * middle: tarfile and webdataset stop at the first zero block and lose the samples after it,
 * silently. The walk does not vouch for such a tar; tarindex.py's check then says which. */
static void past_the_end(Walker *w, const unsigned char *data, size_t len) {
    if (len && (data[0] || memcmp(data, data + 1, len - 1) != 0)) w->state = FAILED;
}

/* Walk the headers that lie in `data`, the bytes at w->fed onwards. */
static void walk_chunk(Walker *w, const unsigned char *data, size_t len) {
    uint64_t base = w->fed;
    size_t pos = 0, tail = len; /* tail: where this chunk's bytes after the end begin */
    size_t need;
    w->fed += len;
    while (w->state == RUNNING) {
        if (w->hold_len) { /* a record split between chunks: gather the rest of it */
            size_t take = w->want - w->hold_len;
            if (take > len - pos) take = len - pos;
            if (!hold_bytes(w, data + pos, take)) goto oom;
            pos += take;
            if (w->hold_len < w->want) return;
            if (take_record(w, w->hold, w->hold_len, &need) == NEED_MORE) {
                w->want = need;
                continue;
            }
            w->hold_len = 0;
            tail = pos;
            continue;
        }
        if (w->next >= w->fed) return; /* the next header lies beyond this chunk */
        size_t at = (size_t)(w->next - base);
        tail = at; /* (the end block itself is zero) */
        if (take_record(w, data + at, len - at, &need) == NEED_MORE) {
            if (!hold_bytes(w, data + at, len - at)) goto oom;
            w->want = need;
            return;
        }
    }
    if (w->state == ENDED) past_the_end(w, data + tail, len - tail);
    return;
oom:
    w->out_of_memory = 1;
    w->state = FAILED;
}

/* The capsule's functions (_tarwalk_api.h); Walker_feed is claim, feed and release. */
static int walker_claim(PyObject *obj) {
    Walker *w = (Walker *)obj;
    if (w->busy) {
        PyErr_SetString(PyExc_RuntimeError, "TarWalker.feed called from two threads at once");
        return -1;
    }
    w->busy = 1;
    return 0;
}

static void walker_feed(PyObject *obj, const unsigned char *data, size_t len) {
    Walker *w = (Walker *)obj;
    if (w->state == RUNNING) {
        walk_chunk(w, data, len);
        return;
    }
    w->fed += (uint64_t)len;
    if (w->state == ENDED) past_the_end(w, data, len);
}

static int walker_release(PyObject *obj) {
    Walker *w = (Walker *)obj;
    w->busy = 0;
    if (w->out_of_memory) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static int walker_vouched(PyObject *obj, size_t *samples) {
    Walker *w = (Walker *)obj;
    if (w->state != ENDED) return 0; /* (as Walker_finish: running, failed or out of memory) */
    *samples = w->n_samples;
    return 1;
}

static PyObject *Walker_feed(Walker *w, PyObject *arg) {
    Py_buffer view;
    if (walker_claim((PyObject *)w) < 0) return NULL;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) {
        w->busy = 0;
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS walker_feed((PyObject *)w, (const unsigned char *)view.buf,
                                       (size_t)view.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    if (walker_release((PyObject *)w) < 0) return NULL;
    Py_RETURN_NONE;
}

/* None unless the walk vouches for the tar; else a dict of the index's parts (see
 * stager/shards/tarnative.py, which makes it a TarIndex). */
/* Members of sample `i`: [*lo, *hi). */
static void sample_members(const Walker *w, size_t i, size_t *lo, size_t *hi) {
    *lo = (size_t)w->sample_start[i];
    *hi = i + 1 < w->n_samples ? (size_t)w->sample_start[i + 1] : w->n_members;
}

/* Whether samples `i` and `j` share no extension: one sample's members scattered, not a
 * sample stored twice. */
static int disjoint(const Walker *w, size_t i, size_t j) {
    size_t ilo, ihi, jlo, jhi;
    sample_members(w, i, &ilo, &ihi);
    sample_members(w, j, &jlo, &jhi);
    for (size_t a = ilo; a < ihi; a++)
        for (size_t b = jlo; b < jhi; b++)
            if (w->members[a].ext == w->members[b].ext) return 0;
    return 1;
}

/* The first sample whose members are another's scattered: its key was met before, in a
 * sample with none of its extensions (GNU tar of a directory stores files in the order the
 * directory lists them: k.jpg, m.jpg, k.cls). Read as webdataset reads it, that is two
 * samples, each missing members. A sample stored twice whole (the same extensions) is two
 * samples, as webdataset reads it. -1 where none, -2 when out of memory. One pass over the
 * keys, through a table of each key's latest sample. */
static int64_t split_sample(const Walker *w) {
    size_t ns = w->n_samples;
    if (ns < 2) return -1;
    size_t cap = 4;
    while (cap < 2 * ns) cap *= 2;
    uint32_t *table = calloc(cap, sizeof(uint32_t)); /* sample + 1; 0 = empty */
    if (!table) return -2;
    int64_t found = -1;
    for (size_t i = 0; i < ns && found < 0; i++) {
        Span k = w->keys[i];
        size_t h = (size_t)hash_bytes(w->arena + k.at, k.len) & (cap - 1);
        while (table[h]) {
            Span o = w->keys[table[h] - 1];
            if (o.len == k.len && !memcmp(w->arena + o.at, w->arena + k.at, k.len)) break;
            h = (h + 1) & (cap - 1);
        }
        if (table[h] && disjoint(w, table[h] - 1, i)) found = (int64_t)i;
        table[h] = (uint32_t)(i + 1);
    }
    free(table);
    return found;
}

static PyObject *Walker_finish(Walker *w, PyObject *Py_UNUSED(ignored)) {
    if (w->busy) {
        PyErr_SetString(PyExc_RuntimeError, "TarWalker.finish called during a feed");
        return NULL;
    }
    if (w->state != ENDED) Py_RETURN_NONE;
    /* Columns as bytes, no Python object per sample or member: a shard of 25,000 samples made
     * 25,000 str keys and a list of 50,000 extensions here, ~3 ms holding the interpreter
     * lock on a copy thread, which only a loader's TarIndex needs (tarnative.to_index). */
    PyObject *result = NULL, *ext_names = NULL, *blob = NULL;
    PyObject *starts = NULL, *codes = NULL, *offsets = NULL, *sizes = NULL, *dup = NULL;
    PyObject *split = NULL;
    size_t ns = w->n_samples, nm = w->n_members, width = w->key_width ? w->key_width : 1;
    ext_names = PyTuple_New((Py_ssize_t)w->n_exts);
    if (!ext_names) goto done;
    for (size_t c = 0; c < w->n_exts; c++) {
        PyObject *s = PyUnicode_DecodeASCII(w->arena + w->exts[c].at, w->exts[c].len, NULL);
        if (!s) goto done;
        PyTuple_SET_ITEM(ext_names, (Py_ssize_t)c, s);
    }
    blob = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(ns * width));
    starts = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)((ns + 1) * sizeof(int64_t)));
    if (!blob || !starts) goto done;
    char *key_bytes = PyBytes_AS_STRING(blob);
    memset(key_bytes, 0, ns * width);
    int64_t *start_out = (int64_t *)PyBytes_AS_STRING(starts);
    for (size_t i = 0; i < ns; i++) {
        Span k = w->keys[i];
        memcpy(key_bytes + i * width, w->arena + k.at, k.len);
        start_out[i] = w->sample_start[i];
    }
    start_out[ns] = (int64_t)nm;
    codes = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(nm * sizeof(int16_t)));
    offsets = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(nm * sizeof(int64_t)));
    sizes = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(nm * sizeof(int64_t)));
    if (!codes || !offsets || !sizes) goto done;
    int16_t *code_out = (int16_t *)PyBytes_AS_STRING(codes);
    int64_t *offset_out = (int64_t *)PyBytes_AS_STRING(offsets);
    int64_t *size_out = (int64_t *)PyBytes_AS_STRING(sizes);
    for (size_t j = 0; j < nm; j++) {
        Member *m = &w->members[j];
        code_out[j] = m->ext;
        offset_out[j] = m->offset;
        size_out[j] = m->size;
    }
    if (w->duplicate >= 0) {
        Member *m = &w->members[w->duplicate];
        Span k = w->keys[w->duplicate_sample];
        PyObject *key = PyUnicode_DecodeASCII(w->arena + k.at, k.len, NULL);
        if (!key) goto done;
        dup = PyUnicode_FromFormat("%U.%U", key, PyTuple_GET_ITEM(ext_names, m->ext));
        Py_DECREF(key);
        if (!dup) goto done;
    } else {
        dup = Py_None;
        Py_INCREF(dup);
    }
    int64_t apart = split_sample(w);
    if (apart == -2) {
        PyErr_NoMemory();
        goto done;
    }
    if (apart >= 0) {
        Span k = w->keys[apart];
        split = PyUnicode_DecodeASCII(w->arena + k.at, k.len, NULL);
        if (!split) goto done;
    } else {
        split = Py_None;
        Py_INCREF(split);
    }
    result = Py_BuildValue("{s:n,s:O,s:n,s:O,s:O,s:O,s:O,s:O,s:O,s:O}", "samples",
                           (Py_ssize_t)ns, "key_bytes", blob, "key_width", (Py_ssize_t)width,
                           "member_start", starts, "ext_names", ext_names, "ext_codes", codes,
                           "offsets", offsets, "sizes", sizes, "duplicate", dup, "split",
                           split);
done:
    Py_XDECREF(ext_names);
    Py_XDECREF(blob);
    Py_XDECREF(starts);
    Py_XDECREF(codes);
    Py_XDECREF(offsets);
    Py_XDECREF(sizes);
    Py_XDECREF(dup);
    Py_XDECREF(split);
    return result;
}

static void Walker_dealloc(Walker *w) {
    free(w->hold);
    free(w->rename);
    free(w->members);
    free(w->sample_start);
    free(w->keys);
    free(w->arena);
    free(w->exts);
    free(w->ext_table);
    Py_TYPE(w)->tp_free((PyObject *)w);
}

static PyObject *Walker_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "", kwlist)) return NULL;
    Walker *w = (Walker *)type->tp_alloc(type, 0);
    if (w) w->duplicate = -1;
    return (PyObject *)w;
}

static PyMethodDef Walker_methods[] = {
    {"feed", (PyCFunction)Walker_feed, METH_O,
     "feed(chunk): look at the tar's next bytes (any buffer; not kept past the call)."},
    {"finish", (PyCFunction)Walker_finish, METH_NOARGS,
     "finish() -> dict | None: the index's parts, or None where the walk does not vouch."},
    {NULL, NULL, 0, NULL}};

static PyMemberDef Walker_members[] = {
    {"fed", T_ULONGLONG, offsetof(Walker, fed), READONLY, "bytes fed so far"},
    {NULL, 0, 0, 0, NULL}};

static PyTypeObject WalkerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "stager.shards._tarwalk.TarWalker",
    .tp_basicsize = sizeof(Walker),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Walks a tar's headers as its bytes are fed; finish() gives the sample index.",
    .tp_new = Walker_new,
    .tp_dealloc = (destructor)Walker_dealloc,
    .tp_methods = Walker_methods,
    .tp_members = Walker_members,
};

static TarWalkAPI walk_api = {&WalkerType, walker_claim, walker_feed, walker_release,
                               walker_vouched};


/* ---- join_walks: the dataset index's columns from many walks, without numpy ----
 *
 * stage-in's finish joins every shard's walk into the loader's one-file index. With numpy
 * that was an import (~70 ms, ~0.15 s with the page cache dropped) and a dozen calls for what
 * is concatenation with offsets added: here, one pass over the walks' bytes. The result must
 * equal what stager/shards/flatindex.py's flatten makes of the same shards, array for array
 * (tests/test_loader_index.py holds the two to each other). */

typedef struct {
    Py_buffer starts, keys, offsets, sizes, codes;
    Py_ssize_t key_width, n_samples, n_members;
} WalkView;

static void release_views(WalkView *v, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        PyBuffer_Release(&v[i].starts);
        PyBuffer_Release(&v[i].keys);
        PyBuffer_Release(&v[i].offsets);
        PyBuffer_Release(&v[i].sizes);
        PyBuffer_Release(&v[i].codes);
    }
}

/* The walk dicts' keys, made once: PyDict_GetItemString makes a new str on every call,
 * ~0.4 us each, which was most of a 10,000-shard join. */
enum { K_STARTS, K_KEYS, K_OFFSETS, K_SIZES, K_CODES, K_WIDTH, K_COUNT };
static const char *const part_names[K_COUNT] = {"member_start", "key_bytes", "offsets",
                                                "sizes", "ext_codes", "key_width"};
static PyObject *part_keys[K_COUNT];

static PyObject *part_of(PyObject *walk, int which) {
    PyObject *part = PyDict_GetItemWithError(walk, part_keys[which]); /* borrowed */
    if (!part && !PyErr_Occurred())
        PyErr_Format(PyExc_KeyError, "a walk has no %s", part_names[which]);
    return part;
}

static int view_part(PyObject *walk, int which, Py_buffer *view) {
    PyObject *part = part_of(walk, which);
    return part && PyObject_GetBuffer(part, view, PyBUF_SIMPLE) == 0;
}

/* A column of int64 values as bytes: uint32 where every value fits, as flatindex._narrow. */
static PyObject *narrowed(const int64_t *values, size_t n) {
    int fits = 1;
    for (size_t i = 0; i < n && fits; i++) fits = values[i] >= 0 && values[i] < ((int64_t)1 << 32);
    PyObject *data;
    if (fits) {
        data = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(n * sizeof(uint32_t)));
        if (!data) return NULL;
        uint32_t *out = (uint32_t *)PyBytes_AS_STRING(data);
        for (size_t i = 0; i < n; i++) out[i] = (uint32_t)values[i];
    } else {
        data = PyBytes_FromStringAndSize((const char *)values, (Py_ssize_t)(n * sizeof(int64_t)));
    }
    if (!data) return NULL;
    return Py_BuildValue("(sN)", fits ? "u4" : "i8", data);
}

static PyObject *join_walks(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *walks, *result = NULL;
    Py_buffer lookup, bases;
    Py_ssize_t n_names;
    PyObject *given;
    if (!PyArg_ParseTuple(args, "Oy*y*n", &given, &lookup, &bases, &n_names)) return NULL;
    /* a tuple of its own: a list changed by a key's __eq__ during a lookup cannot move the
     * items under this loop */
    walks = PySequence_Tuple(given);
    if (!walks) {
        PyBuffer_Release(&lookup);
        PyBuffer_Release(&bases);
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(walks), ready = 0;
    const int32_t *table = (const int32_t *)lookup.buf;
    size_t table_len = (size_t)lookup.len / sizeof(int32_t);
    const int64_t *table_at = (const int64_t *)bases.buf;
    WalkView *v = PyMem_Calloc(n ? (size_t)n : 1, sizeof(WalkView));
    int64_t *starts = NULL, *offsets = NULL, *sizes = NULL;
    PyObject *counts = NULL, *sample_offsets = NULL, *keys = NULL, *ext = NULL;
    PyObject *start_col = NULL, *offset_col = NULL, *size_col = NULL;
    if (!v) goto fail_nomem;
    if ((size_t)bases.len != (size_t)n * sizeof(int64_t)) {
        PyErr_SetString(PyExc_ValueError, "one table base per walk");
        goto done;
    }
    size_t total_s = 0, total_m = 0, width = 0;
    for (; ready < n; ready++) {
        PyObject *walk = PyTuple_GET_ITEM(walks, ready);
        WalkView *w = &v[ready];
        if (!PyDict_Check(walk)) {
            PyErr_SetString(PyExc_TypeError, "walks are the walker's finish() dicts");
            goto done;
        }
        PyObject *kw = part_of(walk, K_WIDTH);
        w->key_width = kw ? PyLong_AsSsize_t(kw) : -1;
        if (w->key_width < 1) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "bad key_width");
            goto done;
        }
        if (!view_part(walk, K_STARTS, &w->starts)) goto done;
        if (!view_part(walk, K_KEYS, &w->keys)) goto done_one;
        if (!view_part(walk, K_OFFSETS, &w->offsets)) goto done_one;
        if (!view_part(walk, K_SIZES, &w->sizes)) goto done_one;
        if (!view_part(walk, K_CODES, &w->codes)) goto done_one;
        w->n_samples = w->starts.len / (Py_ssize_t)sizeof(int64_t) - 1;
        w->n_members = w->sizes.len / (Py_ssize_t)sizeof(int64_t);
        if (w->n_samples < 0 || w->starts.len % (Py_ssize_t)sizeof(int64_t) ||
            w->sizes.len % (Py_ssize_t)sizeof(int64_t) || w->offsets.len != w->sizes.len ||
            w->keys.len % w->key_width || w->keys.len / w->key_width != w->n_samples ||
            w->codes.len != w->n_members * (Py_ssize_t)sizeof(int16_t)) {
            PyErr_SetString(PyExc_ValueError, "a walk's columns differ in length");
            goto done_one; /* (its views are held: done_one counts it for release) */
        }
        /* each sample's first member, in order, from 0 to the member count */
        const int64_t *first = (const int64_t *)w->starts.buf;
        int monotone = first[0] == 0 && first[w->n_samples] == w->n_members;
        for (Py_ssize_t k = 0; monotone && k < w->n_samples; k++)
            monotone = first[k] <= first[k + 1];
        if (!monotone) {
            PyErr_SetString(PyExc_ValueError, "a walk's member_start is not its members' starts");
            goto done_one;
        }
        const char *key = (const char *)w->keys.buf;
        for (Py_ssize_t k = 0; k < w->n_samples; k++) {
            size_t len = strnlen(key + k * w->key_width, (size_t)w->key_width);
            if (len > width) width = len;
        }
        total_s += (size_t)w->n_samples;
        total_m += (size_t)w->n_members;
        continue;
    done_one:
        ready++;
        goto done;
    }
    if (total_s && width > (size_t)PY_SSIZE_T_MAX / total_s) {
        PyErr_SetString(PyExc_ValueError, "the keys would not fit in memory");
        goto done;
    }
    if (width == 0) width = 1;
    counts = PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(int64_t));
    sample_offsets = PyBytes_FromStringAndSize(NULL, (n + 1) * (Py_ssize_t)sizeof(int64_t));
    keys = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(total_s * width));
    int code_bytes = n_names <= 256 ? 1 : (n_names <= 32768 ? 2 : 4);
    ext = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(total_m * (size_t)code_bytes));
    starts = PyMem_Malloc((total_s + 1) * sizeof(int64_t));
    offsets = PyMem_Malloc((total_m ? total_m : 1) * sizeof(int64_t));
    sizes = PyMem_Malloc((total_m ? total_m : 1) * sizeof(int64_t));
    if (!counts || !sample_offsets || !keys || !ext) goto done;
    if (!starts || !offsets || !sizes) goto fail_nomem;
    int64_t *count_out = (int64_t *)PyBytes_AS_STRING(counts);
    int64_t *offset_of_shard = (int64_t *)PyBytes_AS_STRING(sample_offsets);
    char *key_out = PyBytes_AS_STRING(keys);
    unsigned char *ext_out = (unsigned char *)PyBytes_AS_STRING(ext);
    memset(key_out, 0, total_s * width);
    size_t s_at = 0, m_at = 0;
    offset_of_shard[0] = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        WalkView *w = &v[i];
        const int64_t *first = (const int64_t *)w->starts.buf;
        const char *key = (const char *)w->keys.buf;
        const int16_t *code = (const int16_t *)w->codes.buf;
        count_out[i] = w->n_samples;
        offset_of_shard[i + 1] = offset_of_shard[i] + w->n_samples;
        for (Py_ssize_t k = 0; k < w->n_samples; k++) {
            const char *one = key + k * w->key_width;
            memcpy(key_out + (s_at + (size_t)k) * width, one, strnlen(one, (size_t)w->key_width));
            starts[s_at + (size_t)k] = first[k] + (int64_t)m_at;
        }
        memcpy(offsets + m_at, w->offsets.buf, (size_t)w->offsets.len);
        memcpy(sizes + m_at, w->sizes.buf, (size_t)w->sizes.len);
        for (Py_ssize_t j = 0; j < w->n_members; j++) {
            int64_t at = table_at[i] + code[j];
            if (code[j] < 0 || at < 0 || (size_t)at >= table_len || table[at] < 0 ||
                table[at] >= n_names) {
                PyErr_SetString(PyExc_ValueError, "an extension code outside its table");
                goto done;
            }
            size_t out = m_at + (size_t)j;
            if (code_bytes == 1) ext_out[out] = (uint8_t)table[at];
            else if (code_bytes == 2) ((int16_t *)ext_out)[out] = (int16_t)table[at];
            else ((int32_t *)ext_out)[out] = table[at];
        }
        s_at += (size_t)w->n_samples;
        m_at += (size_t)w->n_members;
    }
    starts[total_s] = (int64_t)total_m;
    start_col = narrowed(starts, total_s + 1);
    offset_col = narrowed(offsets, total_m);
    size_col = narrowed(sizes, total_m);
    if (!start_col || !offset_col || !size_col) goto done;
    result = Py_BuildValue("{s:(sO),s:(sO),s:(sO),s:n,s:O,s:(sO),s:O,s:O}",
                           "shard_samples", "i8", counts, "sample_offsets", "i8", sample_offsets,
                           "keys", "S", keys, "key_width", (Py_ssize_t)width, "member_start",
                           start_col, "member_ext",
                           code_bytes == 1 ? "u1" : (code_bytes == 2 ? "i2" : "i4"), ext,
                           "member_offset", offset_col, "member_size", size_col);
    goto done;
fail_nomem:
    PyErr_NoMemory();
done:
    if (v) release_views(v, ready);
    PyMem_Free(v);
    Py_DECREF(walks);
    PyMem_Free(starts);
    PyMem_Free(offsets);
    PyMem_Free(sizes);
    Py_XDECREF(counts);
    Py_XDECREF(sample_offsets);
    Py_XDECREF(keys);
    Py_XDECREF(ext);
    Py_XDECREF(start_col);
    Py_XDECREF(offset_col);
    Py_XDECREF(size_col);
    PyBuffer_Release(&lookup);
    PyBuffer_Release(&bases);
    return result;
}

static PyMethodDef module_methods[] = {
    {"join_walks", join_walks, METH_VARARGS,
     "join_walks(walks, lookup, table_at, n_names) -> dict: the dataset index's columns."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef tarwalk_module = {
    PyModuleDef_HEAD_INIT, "_tarwalk",
    "The compiled tar walk (see stager/shards/tarnative.py).", -1, module_methods};

PyMODINIT_FUNC PyInit__tarwalk(void) {
    if (PyType_Ready(&WalkerType) < 0) return NULL;
    for (int k = 0; k < K_COUNT; k++) {
        if (!part_keys[k] && !(part_keys[k] = PyUnicode_InternFromString(part_names[k])))
            return NULL;
    }
    PyObject *m = PyModule_Create(&tarwalk_module);
    if (!m) return NULL;
    Py_INCREF(&WalkerType);
    if (PyModule_AddObject(m, "TarWalker", (PyObject *)&WalkerType) < 0) {
        Py_DECREF(&WalkerType);
        Py_DECREF(m);
        return NULL;
    }
    PyObject *api = PyCapsule_New(&walk_api, TARWALK_CAPSULE, NULL);
    if (!api || PyModule_AddObject(m, "_C_API", api) < 0) {
        Py_XDECREF(api);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
