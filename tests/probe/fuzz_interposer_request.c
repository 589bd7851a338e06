/* A deterministic mutation fuzzer of the interposer's control-socket request parser (hydration/interposer/
 * request.c), built with gcc -fsanitize=address,undefined -fno-sanitize-recover=all by
 * tests/probe/test_interposer_request_fuzz.py: any out-of-bounds read or write, overflow or other undefined
 * behaviour aborts the run with the sanitizer's report.
 *
 * Usage: fuzz_interposer_request INPUTS SEED. Each input is one of the corpus's valid requests with 1 to 8
 * mutations (bit flips, bytes from a dictionary of JSON's own characters, tokens such as `\u00` or a key name,
 * deletions, duplications, truncations, splices with another request, runs long enough to pass every field's
 * limit), copied into a buffer of exactly its length plus the NUL (so that reading one byte past it is
 * reported), and parsed. Besides the sanitizers, every input must keep the parser's contract:
 *   - a refusal leaves a NUL-terminated message within the error buffer, naming one of the known rules;
 *   - an accepted request has every field NUL-terminated within its size, and serialising it again and parsing
 *     that gives the same request (the round trip);
 *   - `allocations` is counted as an independent reading of its digits says.
 * A broken property prints the input (hex) and aborts. The last line is JSON: inputs, accepted, refused, and the
 * refusals per rule (the test requires every rule to be reached). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "request.h"

#define MAX_INPUT 70000 /* the control socket reads at most 65536 bytes a line */

static const char *const corpus[] = {
    "{\"op\":\"status\"}",
    "{\"op\":\"release\",\"dir\":\"/images/device-42\"}",
    "{\"op\":\"hydrate\",\"dir\":\"/images/d\",\"policy\":\"same-gpu\",\"verify\":\"digest\",\"allocations\":\"3\"}",
    " { \"op\" : \"hydrate\" ,\t\"allocations\" : \"4096\" }\r\n",
    "{\"op\":\"hydrate\",\"dir\":\"\"}",
    "{\"op\":\"st\\u0061tus\",\"policy\":\"same-model\"}",
    "{\"dir\":\"/a\\/b\\\\c\\\"d\\n\\t\\r\\b\\f\\u001f\"}",
    "{}",
    "{\"verify\":\"none\",\"op\":\"hydrate\",\"allocations\":\"0016\"}",
};
enum { CORPUS = sizeof(corpus) / sizeof(corpus[0]) };

static const char dictionary[] = "\"\\{}:,u0123456789abcdefABCDEF \t\r\n/\x01\x1f\x7f\x80\xff";
static const char *const tokens[] = {
    "\"op\"", "\"dir\"", "\"policy\"", "\"verify\"", "\"allocations\"", "\\u", "\\u00", "\\u0041", "\\u0000",
    "\\u0080", "\\uFFFF", "\\u7", "\\", "\\\"", "\":\"", "\",\"", "{", "}", "\"", ":", ",", "\"hydrate\"",
    "\"4097\"", "\"99999999999999999999999\"", "\"-1\"",
};
enum { TOKENS = sizeof(tokens) / sizeof(tokens[0]) };

/* The refusals' rules, by a phrase of their message (request.c). */
static const char *const rules[] = {
    "is not one JSON object", "expected a key", "must be a string", "unknown key", "appears twice",
    "` is longer than", "a string is longer than", "expected `,` or `}`", "trailing data",
    "control characters must be escaped", "only printable ASCII", "bad escape", "unterminated string",
};
enum { RULES = sizeof(rules) / sizeof(rules[0]) };

static uint64_t state;

static uint64_t next(void)  /* splitmix64: one seed, one sequence, on every machine */
{
    uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

static size_t below(size_t n) { return n ? (size_t)(next() % n) : 0; }

static void fail(const char *why, const char *input, size_t size)
{
    fprintf(stderr, "property broken: %s\ninput (%zu bytes):", why, size);
    for (size_t i = 0; i < size && i < 4096; i++)
        fprintf(stderr, "%02x", (unsigned char)input[i]);
    fprintf(stderr, "\n");
    abort();
}

/* Insert `n` bytes of `what` at `at` (within `*size`, growing it up to MAX_INPUT). */
static void insert(char *buf, size_t *size, size_t at, const char *what, size_t n)
{
    if (*size + n > MAX_INPUT)
        n = MAX_INPUT - *size;
    memmove(buf + at + n, buf + at, *size - at);
    memcpy(buf + at, what, n);
    *size += n;
}

static void mutate(char *buf, size_t *size)
{
    size_t at = below(*size + 1), n;
    char run[5000];
    switch (below(10)) {
    case 0: if (*size) buf[below(*size)] ^= (char)(1u << below(8)); break;
    case 1: if (*size) buf[below(*size)] = (char)next(); break;
    case 2: if (*size) buf[below(*size)] = dictionary[below(sizeof(dictionary) - 1)]; break;
    case 3: insert(buf, size, at, &dictionary[below(sizeof(dictionary) - 1)], 1); break;
    case 4: n = below(*size - at + 1); memmove(buf + at, buf + at + n, *size - at - n); *size -= n; break;
    case 5:
        n = below(*size - at + 1);
        memcpy(run, buf + at, n < sizeof(run) ? n : sizeof(run));
        insert(buf, size, below(*size + 1), run, n < sizeof(run) ? n : sizeof(run));
        break;
    case 6: { const char *t = tokens[below(TOKENS)]; insert(buf, size, at, t, strlen(t)); break; }
    case 7: *size = below(*size + 1); break;
    case 8: {  /* a run past a limit: 31 (short fields), 63 (keys), 4095 (dir) and around them */
        static const size_t lengths[] = {23, 24, 31, 32, 63, 64, 4095, 4096, 4999};
        n = lengths[below(sizeof(lengths) / sizeof(lengths[0]))];
        memset(run, "a\\"[below(4) == 0], n);
        insert(buf, size, at, run, n);
        break;
    }
    default: {  /* splice: this input's head, another request's tail */
        const char *other = corpus[below(CORPUS)];
        size_t from = below(strlen(other) + 1);
        *size = at;
        insert(buf, size, at, other + from, strlen(other) - from);
        break;
    }
    }
}

/* `value` as a JSON string (escaping what the parser requires escaped) at `out`; the end. */
static char *quote(char *out, const char *value)
{
    *out++ = '"';
    for (const unsigned char *p = (const unsigned char *)value; *p; p++) {
        if (*p == '"' || *p == '\\') {
            *out++ = '\\';
            *out++ = (char)*p;
        } else if (*p < 0x20) {
            out += sprintf(out, "\\u%04x", *p);
        } else {
            *out++ = (char)*p;
        }
    }
    *out++ = '"';
    return out;
}

static void check_accepted(const struct cscu_request *req, const char *input, size_t size)
{
    static char again[6 * CSCU_REQUEST_FIELD + 1024];
    struct cscu_request back;
    char error[512], *out = again;
    const struct { const char *name; const char *value; size_t room; int present; } fields[] = {
        {"op", req->op, sizeof(req->op), req->op[0] != 0}, {"dir", req->dir, sizeof(req->dir), req->has_dir},
        {"policy", req->policy, sizeof(req->policy), req->policy[0] != 0},
        {"verify", req->verify, sizeof(req->verify), req->verify[0] != 0},
        {"allocations", req->allocations, sizeof(req->allocations), req->allocations[0] != 0}};
    *out++ = '{';
    for (size_t f = 0; f < sizeof(fields) / sizeof(fields[0]); f++) {
        if (strnlen(fields[f].value, fields[f].room) >= fields[f].room)
            fail("an accepted field is not NUL-terminated within its size", input, size);
        if (!fields[f].present)
            continue;
        out += sprintf(out, "%s\"%s\":", out[-1] == '{' ? "" : ",", fields[f].name);
        out = quote(out, fields[f].value);
    }
    strcpy(out, "}");
    if (cscu_request_parse(again, &back, error, sizeof(error)) != 0)
        fail("an accepted request, serialised again, is refused", input, size);
    if (strcmp(back.op, req->op) || strcmp(back.dir, req->dir) || strcmp(back.policy, req->policy)
        || strcmp(back.verify, req->verify) || strcmp(back.allocations, req->allocations)
        || back.has_dir != req->has_dir)
        fail("an accepted request does not survive its round trip", input, size);
    /* `allocations`, read independently: digits only, 1 to 4096 (leading zeros allowed). */
    const char *digits = req->allocations;
    long expect = 0;
    if (*digits) {
        size_t n = strspn(digits, "0123456789");
        while (*digits == '0' && digits[1])
            digits++, n--;
        expect = n != strlen(digits) || n > 4 || atol(digits) == 0 || atol(digits) > 4096 ? -1 : atol(digits);
    }
    if (cscu_request_allocations(req, 4096) != expect)
        fail("`allocations` is not counted as its digits say", input, size);
}

int main(int argc, char **argv)
{
    static char work[MAX_INPUT + 1];
    static const size_t rooms[] = {512, 512, 512, 64, 1};
    unsigned long inputs, accepted = 0, refused = 0, per_rule[RULES] = {0};
    struct cscu_request req;
    char error[512];
    if (argc != 3)
        return 2;
    inputs = strtoul(argv[1], NULL, 10);
    state = strtoull(argv[2], NULL, 10);
    for (size_t i = 0; i < CORPUS; i++)  /* the corpus itself is valid */
        if (cscu_request_parse(corpus[i], &req, error, sizeof(error)) != 0)
            fail(error, corpus[i], strlen(corpus[i]));
    for (unsigned long k = 0; k < inputs; k++) {
        const char *seed = corpus[below(CORPUS)];
        size_t size = strlen(seed), room = rooms[below(sizeof(rooms) / sizeof(rooms[0]))];
        memcpy(work, seed, size);
        for (size_t m = 1 + below(8); m > 0; m--)
            mutate(work, &size);
        char *input = malloc(size + 1);  /* exactly its bytes and the NUL: one byte further is reported */
        if (!input)
            return 3;
        memcpy(input, work, size);
        input[size] = '\0';
        memset(error, 'x', sizeof(error));
        int rc = cscu_request_parse(input, &req, error, room);
        if (rc == 0) {
            accepted++;
            check_accepted(&req, input, size);
        } else if (rc != -1 || strnlen(error, room) >= room) {
            fail("a refusal's message is not NUL-terminated within its buffer", input, size);
        } else {
            refused++;
            if (room == sizeof(error)) {
                size_t r = 0;
                while (r < RULES && !strstr(error, rules[r]))
                    r++;
                if (r == RULES)
                    fail(error, input, size);  /* a refusal that names no known rule */
                per_rule[r]++;
            }
        }
        free(input);
    }
    printf("{\"inputs\": %lu, \"accepted\": %lu, \"refused\": %lu, \"rules\": {", inputs, accepted, refused);
    for (size_t r = 0; r < RULES; r++)
        printf("%s\"%s\": %lu", r ? ", " : "", rules[r], per_rule[r]);
    printf("}}\n");
    return 0;
}
