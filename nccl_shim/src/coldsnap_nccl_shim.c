/* coldsnap_nccl_shim.c - see coldsnap_nccl_shim.h. NCCL is never linked: everything is found at run time. */
#define _GNU_SOURCE
#include "coldsnap_nccl_shim.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "coldsnap_nccl_provider.h"

struct csns_handle {
    void *library; /* NULL: the process-global namespace */
    coldsnap_nccl_provider_query_fn provider_query;
    coldsnap_nccl_in_place_query_fn in_place_query;
    coldsnap_nccl_resources_query_fn resources_query;
    int32_t (*checkpoint_get_version)(int *, int *);
    int32_t (*nccl_get_version)(int *);
    unsigned int (*dlsym_bridge_abi)(void);
};

static pthread_mutex_t state_lock = PTHREAD_MUTEX_INITIALIZER;
static uint32_t in_place_state = CSNS_STATE_ACTIVE;
static uint32_t recreate_state = CSNS_RECREATE_IDLE;
static __thread char last_error[512];

static void *lookup(const csns_handle *h, const char *name) {
    return h->library ? dlsym(h->library, name) : dlsym(RTLD_DEFAULT, name);
}

int32_t csns_open(const char *library, csns_handle **out) {
    if (out == NULL) return CSNS_E_ARGUMENT;
    *out = NULL;
    csns_handle *h = calloc(1, sizeof *h);
    if (h == NULL) return CSNS_E_ARGUMENT;
    if (library != NULL) {
        h->library = dlopen(library, RTLD_NOW | RTLD_GLOBAL);
        if (h->library == NULL) {
            const char *why = dlerror();
            strncpy(last_error, why ? why : "dlopen failed", sizeof last_error - 1);
            free(h);
            return CSNS_E_LOAD;
        }
    }
    /* dlsym returns void*; converting to function pointers is what POSIX guarantees to work. */
    *(void **)&h->provider_query = lookup(h, "coldsnapNcclProviderQuery");
    *(void **)&h->in_place_query = lookup(h, "coldsnapNcclInPlaceQuery");
    *(void **)&h->resources_query = lookup(h, "coldsnapNcclResourcesQuery");
    *(void **)&h->checkpoint_get_version = lookup(h, "ncclCheckpointGetVersion");
    *(void **)&h->nccl_get_version = lookup(h, "ncclGetVersion");
    *(void **)&h->dlsym_bridge_abi = lookup(h, "coldsnapNcclDlsymBridgeAbi");
    *out = h;
    return CSNS_OK;
}

void csns_close(csns_handle *h) {
    if (h == NULL) return;
    /* Tables are provider-owned and the process may keep using the provider: never dlclose. */
    free(h);
}

void csns_last_error(char *buffer, size_t capacity) {
    if (buffer == NULL || capacity == 0) return;
    strncpy(buffer, last_error, capacity - 1);
    buffer[capacity - 1] = '\0';
}

uint32_t csns_version(void) { return CSNS_VERSION; }

#define FIELD(table, member) (uint32_t) offsetof(struct table, member)

uint32_t csns_layout(uint32_t table, uint32_t field) {
    static const uint32_t provider[] = {
        FIELD(coldsnap_nccl_provider_v1, struct_size),       FIELD(coldsnap_nccl_provider_v1, abi_major),
        FIELD(coldsnap_nccl_provider_v1, abi_minor),         FIELD(coldsnap_nccl_provider_v1, provider_revision),
        FIELD(coldsnap_nccl_provider_v1, compiled_nccl_version),
        FIELD(coldsnap_nccl_provider_v1, loaded_nccl_version),
        FIELD(coldsnap_nccl_provider_v1, checkpoint_abi_version), FIELD(coldsnap_nccl_provider_v1, reserved0),
        FIELD(coldsnap_nccl_provider_v1, capability_mask),   FIELD(coldsnap_nccl_provider_v1, provider_id),
        FIELD(coldsnap_nccl_provider_v1, prepare),           FIELD(coldsnap_nccl_provider_v1, restore),
        FIELD(coldsnap_nccl_provider_v1, network_reset),     FIELD(coldsnap_nccl_provider_v1, network_init),
        FIELD(coldsnap_nccl_provider_v1, ib_status),         FIELD(coldsnap_nccl_provider_v1, comm_get_real)};
    static const uint32_t in_place[] = {
        FIELD(coldsnap_nccl_in_place_v1, struct_size),          FIELD(coldsnap_nccl_in_place_v1, abi_major),
        FIELD(coldsnap_nccl_in_place_v1, abi_minor),            FIELD(coldsnap_nccl_in_place_v1, reserved0),
        FIELD(coldsnap_nccl_in_place_v1, communicator_suspend), FIELD(coldsnap_nccl_in_place_v1, transport_detach),
        FIELD(coldsnap_nccl_in_place_v1, transport_reattach),   FIELD(coldsnap_nccl_in_place_v1, communicator_resume),
        FIELD(coldsnap_nccl_in_place_v1, evidence_json)};
    static const uint32_t resources[] = {
        FIELD(coldsnap_nccl_resources_v1, struct_size), FIELD(coldsnap_nccl_resources_v1, abi_major),
        FIELD(coldsnap_nccl_resources_v1, abi_minor),   FIELD(coldsnap_nccl_resources_v1, reserved0),
        FIELD(coldsnap_nccl_resources_v1, inspect),     FIELD(coldsnap_nccl_resources_v1, evidence_json)};
    const uint32_t *fields;
    uint32_t count, size;
    switch (table) {
    case CSNS_TABLE_PROVIDER: fields = provider, count = 16, size = sizeof(struct coldsnap_nccl_provider_v1); break;
    case CSNS_TABLE_IN_PLACE: fields = in_place, count = 9, size = sizeof(struct coldsnap_nccl_in_place_v1); break;
    case CSNS_TABLE_RESOURCES: fields = resources, count = 6, size = sizeof(struct coldsnap_nccl_resources_v1); break;
    default: return 0;
    }
    if (field == CSNS_LAYOUT_SIZE) return size;
    return field < count ? fields[field] : 0;
}

/* Every table starts with struct_size, abi_major, abi_minor: check those before reading further. */
struct table_header {
    uint32_t struct_size;
    uint32_t abi_major;
    uint32_t abi_minor;
};

static int32_t check_table(int32_t query_result, const void *table, size_t needed) {
    if (query_result != 0) return query_result;
    if (table == NULL) return CSNS_E_NULL_TABLE;
    const struct table_header *head = table;
    if (head->abi_major != 1u) return CSNS_E_ABI; /* every ABI here is major 1 */
    if (head->struct_size < needed) return CSNS_E_TRUNCATED;
    return CSNS_OK;
}

static const struct coldsnap_nccl_provider_v1 *provider_table(csns_handle *h, int32_t *status) {
    const struct coldsnap_nccl_provider_v1 *t = NULL;
    if (h->provider_query == NULL) return *status = CSNS_E_MISSING, NULL;
    int32_t rc = h->provider_query(COLDSNAP_NCCL_PROVIDER_ABI_MAJOR, &t); /* before reading t: argument order is unspecified */
    *status = check_table(rc, t, sizeof *t);
    return *status == CSNS_OK ? t : NULL;
}

static const struct coldsnap_nccl_in_place_v1 *in_place_table(csns_handle *h, int32_t *status) {
    const struct coldsnap_nccl_in_place_v1 *t = NULL;
    if (h->in_place_query == NULL) return *status = CSNS_E_MISSING, NULL;
    int32_t rc = h->in_place_query(COLDSNAP_NCCL_IN_PLACE_ABI_MAJOR, &t); /* before reading t: argument order is unspecified */
    *status = check_table(rc, t, sizeof *t);
    return *status == CSNS_OK ? t : NULL;
}

static const struct coldsnap_nccl_resources_v1 *resources_table(csns_handle *h, int32_t *status) {
    const struct coldsnap_nccl_resources_v1 *t = NULL;
    if (h->resources_query == NULL) return *status = CSNS_E_MISSING, NULL;
    int32_t rc = h->resources_query(COLDSNAP_NCCL_RESOURCES_ABI_MAJOR, &t); /* before reading t: argument order is unspecified */
    *status = check_table(rc, t, sizeof *t);
    return *status == CSNS_OK ? t : NULL;
}

int32_t csns_identity(csns_handle *h, struct csns_identity *out) {
    if (h == NULL || out == NULL || out->size != sizeof *out) return CSNS_E_ARGUMENT;
    memset(out, 0, sizeof *out);
    out->size = sizeof *out;
    out->exports = (h->provider_query ? CSNS_EXPORT_PROVIDER_QUERY : 0) |
                   (h->in_place_query ? CSNS_EXPORT_IN_PLACE_QUERY : 0) |
                   (h->resources_query ? CSNS_EXPORT_RESOURCES_QUERY : 0) |
                   (h->checkpoint_get_version ? CSNS_EXPORT_CHECKPOINT_GET_VERSION : 0) |
                   (h->nccl_get_version ? CSNS_EXPORT_NCCL_GET_VERSION : 0) |
                   (h->dlsym_bridge_abi ? CSNS_EXPORT_DLSYM_BRIDGE_ABI : 0);
    if (h->checkpoint_get_version) {
        int checkpoint = 0, nccl = 0;
        out->checkpoint_version_result = h->checkpoint_get_version(&checkpoint, &nccl);
        out->checkpoint_version = checkpoint;
        out->checkpoint_nccl_version = nccl;
    }
    if (h->nccl_get_version) {
        int version = 0;
        out->nccl_get_version_result = h->nccl_get_version(&version);
        out->nccl_version = version;
    }
    if (h->dlsym_bridge_abi) out->dlsym_bridge_abi = h->dlsym_bridge_abi();
    if (h->provider_query == NULL) return CSNS_OK;
    const struct coldsnap_nccl_provider_v1 *t = NULL;
    /* Read the 12-byte header first: a short table is reported, never read past its end. */
    const struct coldsnap_nccl_provider_v1 *raw = NULL;
    out->query_result = h->provider_query(COLDSNAP_NCCL_PROVIDER_ABI_MAJOR, &raw);
    if (out->query_result != 0) return CSNS_OK;
    if (raw == NULL) return CSNS_E_NULL_TABLE;
    out->struct_size = raw->struct_size;
    out->abi_major = raw->abi_major;
    out->abi_minor = raw->abi_minor;
    if (raw->struct_size < sizeof(struct coldsnap_nccl_provider_v1)) return CSNS_OK; /* truncated: stop here */
    t = raw;
    out->provider_revision = t->provider_revision;
    out->compiled_nccl_version = t->compiled_nccl_version;
    out->loaded_nccl_version = t->loaded_nccl_version;
    out->checkpoint_abi_version = t->checkpoint_abi_version;
    out->capability_mask = t->capability_mask;
    out->slots = (t->prepare ? 1u : 0) | (t->restore ? 2u : 0) | (t->network_reset ? 4u : 0) |
                 (t->network_init ? 8u : 0) | (t->ib_status ? 16u : 0) | (t->comm_get_real ? 32u : 0);
    if (t->provider_id != NULL) {
        size_t n = strnlen(t->provider_id, CSNS_PROVIDER_ID_MAX);
        out->provider_id_state = n < CSNS_PROVIDER_ID_MAX ? 1 : 2;
        memcpy(out->provider_id, t->provider_id, n < CSNS_PROVIDER_ID_MAX ? n : CSNS_PROVIDER_ID_MAX - 1);
    }
    return CSNS_OK;
}

/* Start a csns_table_info; CSNS_OK means `table` may be read up to `needed` bytes (else *status). */
static int csns_info_begin(struct csns_table_info *out, int32_t query_result, const void *table, size_t needed,
                           int32_t *status) {
    out->query_result = query_result;
    *status = query_result == 0 && table == NULL ? CSNS_E_NULL_TABLE : CSNS_OK;
    if (query_result != 0 || table == NULL) return 0;
    const struct table_header *head = table;
    out->struct_size = head->struct_size;
    out->abi_major = head->abi_major;
    out->abi_minor = head->abi_minor;
    return head->struct_size >= needed;
}

static int32_t csns_info_reset(struct csns_table_info *out, int exported) {
    if (out == NULL || out->size != sizeof *out) return CSNS_E_ARGUMENT;
    memset(out, 0, sizeof *out);
    out->size = sizeof *out;
    return exported ? CSNS_OK : CSNS_E_MISSING;
}

int32_t csns_in_place_info(csns_handle *h, struct csns_table_info *out) {
    if (h == NULL) return CSNS_E_ARGUMENT;
    int32_t status = csns_info_reset(out, h->in_place_query != NULL);
    if (status != CSNS_OK) return status;
    const struct coldsnap_nccl_in_place_v1 *t = NULL;
    int32_t rc = h->in_place_query(COLDSNAP_NCCL_IN_PLACE_ABI_MAJOR, &t);
    if (csns_info_begin(out, rc, t, sizeof *t, &status))
        out->slots = (t->communicator_suspend ? 1u : 0) | (t->transport_detach ? 2u : 0) |
                     (t->transport_reattach ? 4u : 0) | (t->communicator_resume ? 8u : 0) |
                     (t->evidence_json ? 16u : 0);
    return status;
}

int32_t csns_resources_info(csns_handle *h, struct csns_table_info *out) {
    if (h == NULL) return CSNS_E_ARGUMENT;
    int32_t status = csns_info_reset(out, h->resources_query != NULL);
    if (status != CSNS_OK) return status;
    const struct coldsnap_nccl_resources_v1 *t = NULL;
    int32_t rc = h->resources_query(COLDSNAP_NCCL_RESOURCES_ABI_MAJOR, &t);
    if (csns_info_begin(out, rc, t, sizeof *t, &status))
        out->slots = (t->inspect ? 1u : 0) | (t->evidence_json ? 2u : 0);
    return status;
}

void csns_state(uint32_t *in_place, uint32_t *recreate) {
    pthread_mutex_lock(&state_lock);
    if (in_place) *in_place = in_place_state;
    if (recreate) *recreate = recreate_state;
    pthread_mutex_unlock(&state_lock);
}

int32_t csns_in_place_call(csns_handle *h, uint32_t operation) {
    static const uint32_t from[] = {CSNS_STATE_ACTIVE, CSNS_STATE_SUSPENDED, CSNS_STATE_TRANSPORT_DETACHED,
                                    CSNS_STATE_TRANSPORT_REATTACHED};
    static const uint32_t to[] = {CSNS_STATE_SUSPENDED, CSNS_STATE_TRANSPORT_DETACHED,
                                  CSNS_STATE_TRANSPORT_REATTACHED, CSNS_STATE_ACTIVE};
    if (h == NULL || operation > CSNS_IN_PLACE_RESUME) return CSNS_E_ARGUMENT;
    pthread_mutex_lock(&state_lock);
    int32_t rc;
    if (in_place_state != from[operation] || recreate_state != CSNS_RECREATE_IDLE) {
        rc = CSNS_E_STATE;
    } else {
        const struct coldsnap_nccl_in_place_v1 *t = in_place_table(h, &rc);
        coldsnap_nccl_provider_operation_fn fn = NULL;
        if (t != NULL) {
            fn = operation == CSNS_IN_PLACE_SUSPEND ? t->communicator_suspend
                 : operation == CSNS_IN_PLACE_DETACH ? t->transport_detach
                 : operation == CSNS_IN_PLACE_REATTACH ? t->transport_reattach
                                                      : t->communicator_resume;
            rc = fn ? fn() : CSNS_E_NO_SLOT;
        }
        if (rc == 0) in_place_state = to[operation];
        /* A suspend refused by the provider changed nothing; a failure after it is fatal. */
        else if (fn != NULL && operation != CSNS_IN_PLACE_SUSPEND) in_place_state = CSNS_STATE_FAILED;
    }
    pthread_mutex_unlock(&state_lock);
    return rc;
}

int32_t csns_recreate_call(csns_handle *h, uint32_t operation) {
    if (h == NULL || operation > CSNS_RECREATE_NETWORK_INIT) return CSNS_E_ARGUMENT;
    pthread_mutex_lock(&state_lock);
    int32_t rc = CSNS_OK;
    uint32_t need = operation == CSNS_RECREATE_PREPARE ? CSNS_RECREATE_IDLE : CSNS_RECREATE_PREPARED;
    if (recreate_state != need || in_place_state != CSNS_STATE_ACTIVE) {
        rc = CSNS_E_STATE;
    } else {
        const struct coldsnap_nccl_provider_v1 *t = provider_table(h, &rc);
        if (t != NULL) {
            coldsnap_nccl_provider_operation_fn fn = operation == CSNS_RECREATE_PREPARE ? t->prepare
                                                     : operation == CSNS_RECREATE_RESTORE ? t->restore
                                                     : operation == CSNS_RECREATE_NETWORK_RESET ? t->network_reset
                                                                                                : t->network_init;
            if (fn == NULL) {
                rc = CSNS_E_NO_SLOT;
            } else {
                rc = fn();
                if (operation == CSNS_RECREATE_PREPARE && rc == 0) recreate_state = CSNS_RECREATE_PREPARED;
                if (operation == CSNS_RECREATE_RESTORE) recreate_state = CSNS_RECREATE_RESTORED;
            }
        }
    }
    pthread_mutex_unlock(&state_lock);
    return rc;
}

static int32_t copy_evidence(const char *text, char *buffer, size_t capacity, size_t *length) {
    if (text == NULL) return CSNS_E_NO_EVIDENCE;
    size_t n = strnlen(text, CSNS_EVIDENCE_MAX + 1);
    *length = n;
    if (n > CSNS_EVIDENCE_MAX) return CSNS_E_TOO_LARGE;
    if (buffer == NULL || capacity < n + 1) return CSNS_E_BUFFER;
    memcpy(buffer, text, n);
    buffer[n] = '\0';
    return CSNS_OK;
}

int32_t csns_in_place_evidence(csns_handle *h, char *buffer, size_t capacity, size_t *length) {
    if (h == NULL || length == NULL) return CSNS_E_ARGUMENT;
    *length = 0;
    int32_t rc;
    const struct coldsnap_nccl_in_place_v1 *t = in_place_table(h, &rc);
    if (t == NULL) return rc;
    if (t->evidence_json == NULL) return CSNS_E_NO_SLOT;
    return copy_evidence(t->evidence_json(), buffer, capacity, length);
}

int32_t csns_resources_inspect(csns_handle *h, uint32_t mode, int32_t *inspect_result, char *buffer,
                               size_t capacity, size_t *length) {
    if (h == NULL || inspect_result == NULL || length == NULL) return CSNS_E_ARGUMENT;
    *length = 0;
    int32_t rc;
    const struct coldsnap_nccl_resources_v1 *t = resources_table(h, &rc);
    if (t == NULL) return rc;
    if (t->inspect == NULL || t->evidence_json == NULL) return CSNS_E_NO_SLOT;
    *inspect_result = t->inspect(mode);
    /* The evidence is thread-local in the provider: read it on the same thread, right away. */
    return copy_evidence(t->evidence_json(), buffer, capacity, length);
}

int32_t csns_ib_status(csns_handle *h, int32_t status[4]) {
    if (h == NULL || status == NULL) return CSNS_E_ARGUMENT;
    int32_t rc;
    const struct coldsnap_nccl_provider_v1 *t = provider_table(h, &rc);
    if (t == NULL) return rc;
    if (t->ib_status == NULL) return CSNS_E_NO_SLOT;
    return t->ib_status(&status[0], &status[1], &status[2], &status[3]);
}
