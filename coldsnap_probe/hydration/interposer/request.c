/* The control socket's request parser (request.h): a flat JSON object of string values, nothing else.
 * Split from control.c so that it is one file with one job, and so that a test can compile it alone under the
 * sanitizers (tests/probe/fuzz_interposer_request.c). */
#include <stdio.h>
#include <string.h>

#include "request.h"

static const char *skip(const char *p) { while (*p == ' ' || *p == '\t' || *p == '\r' || *p == '\n') p++; return p; }

/* A JSON string at p (after its quote) into out; the end, or NULL with `error` set. */
static const char *string(const char *p, char *out, size_t room, char *error, size_t error_room)
{
    size_t n = 0;
    for (; *p && *p != '"'; p++) {
        char c = *p;
        if ((unsigned char)c < 0x20) {
            snprintf(error, error_room, "control characters must be escaped in strings");
            return NULL;
        }
        if (c == '\\') {
            p++;
            switch (*p) {
            case '"': case '\\': case '/': c = *p; break;
            case 'n': c = '\n'; break;
            case 't': c = '\t'; break;
            case 'r': c = '\r'; break;
            case 'b': c = '\b'; break;
            case 'f': c = '\f'; break;
            case 'u': {
                /* Exactly four hex digits (sscanf's %4x took fewer, a sign or spaces, and the parse then went on
                 * past them: past the line's end, or reading "\u73XXtatus" as "status"). */
                unsigned code = 0;
                for (int k = 1; k <= 4; k++) {
                    char h = p[k];  /* a NUL ends the digits: nothing past the string is read */
                    int digit = h >= '0' && h <= '9' ? h - '0' : h >= 'a' && h <= 'f' ? h - 'a' + 10
                                : h >= 'A' && h <= 'F' ? h - 'A' + 10 : -1;
                    if (digit < 0) {
                        code = 0;
                        break;
                    }
                    code = code * 16 + (unsigned)digit;
                }
                if (code == 0 || code > 0x7f) {
                    snprintf(error, error_room, "only printable ASCII \\u escapes (four hex digits) are accepted");
                    return NULL;
                }
                c = (char)code;
                p += 4;
                break;
            }
            default:
                snprintf(error, error_room, "bad escape in a string");
                return NULL;
            }
        }
        if (n + 1 >= room) {
            snprintf(error, error_room, "a string is longer than %zu bytes", room - 1);
            return NULL;
        }
        out[n++] = c;
    }
    if (*p != '"') {
        snprintf(error, error_room, "unterminated string");
        return NULL;
    }
    out[n] = '\0';
    return p + 1;
}

/* Parse {"op": ..., "dir": ..., "policy": ..., "verify": ...}; 0, or -1 with `error` naming the key and the rule. */
int cscu_request_parse(const char *line, struct cscu_request *req, char *error, size_t room)
{
    char key[64], value[CSCU_REQUEST_FIELD];
    const char *p = skip(line);
    memset(req, 0, sizeof(*req));
    const struct { const char *name; char *into; size_t room; } fields[] = {
        {"op", req->op, sizeof(req->op)}, {"dir", req->dir, sizeof(req->dir)},
        {"policy", req->policy, sizeof(req->policy)}, {"verify", req->verify, sizeof(req->verify)},
        {"allocations", req->allocations, sizeof(req->allocations)}};
    enum { FIELDS = sizeof(fields) / sizeof(fields[0]) };
    unsigned seen = 0;
    if (*p++ != '{') {
        snprintf(error, room, "the request is not one JSON object");
        return -1;
    }
    for (p = skip(p); *p != '}';) {
        if (*p != '"') {
            snprintf(error, room, "expected a key");
            return -1;
        }
        if (!(p = string(p + 1, key, sizeof(key), error, room)))
            return -1;
        if (*(p = skip(p)) != ':' || *(p = skip(p + 1)) != '"') {
            snprintf(error, room, "`%s` must be a string", key);
            return -1;
        }
        if (!(p = string(p + 1, value, sizeof(value), error, room)))
            return -1;
        /* Each key once (a second `op` or `dir` is refused, not the last one taken), each within its field. */
        size_t f = 0;
        while (f < FIELDS && strcmp(key, fields[f].name) != 0)
            f++;
        if (f == FIELDS) {
            snprintf(error, room, "unknown key `%.60s`", key);
            return -1;
        }
        if (seen & (1u << f) || strlen(value) >= fields[f].room) {
            snprintf(error, room, seen & (1u << f) ? "`%s` appears twice" : "`%s` is longer than %zu bytes",
                     fields[f].name, fields[f].room - 1);
            return -1;
        }
        strcpy(fields[f].into, value);
        seen |= 1u << f;
        req->has_dir = (seen & 2u) != 0;
        p = skip(p);
        if (*p == ',')
            p = skip(p + 1);
        else if (*p != '}') {
            snprintf(error, room, "expected `,` or `}` after `%s`", key);
            return -1;
        }
    }
    if (*skip(p + 1)) {
        snprintf(error, room, "trailing data after the object");
        return -1;
    }
    return 0;
}

/* The staged allocations the asker announced (`allocations`, decimal, 1 to `most`), 0 when absent, or -1. */
long cscu_request_allocations(const struct cscu_request *req, size_t most)
{
    unsigned long long value = 0;
    if (!req->allocations[0])
        return 0;
    for (const char *p = req->allocations; *p; p++) {  /* digits only: no sign, space or exponent */
        if (*p < '0' || *p > '9' || value > most)
            return -1;
        value = value * 10 + (unsigned long long)(*p - '0');
    }
    return value == 0 || value > most ? -1 : (long)value;
}

