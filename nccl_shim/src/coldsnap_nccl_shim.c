/* coldsnap_nccl_shim.c - see coldsnap_nccl_shim.h. NCCL is never linked: everything is found at run time. */
#define _GNU_SOURCE
#include "coldsnap_nccl_shim.h"

#include <dlfcn.h>
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
