/*
 * coldsnap_nccl_shim.h - a small, stable C API over the ColdSnap NCCL provider ABIs.
 *
 * The shim finds the provider's query exports (process-global namespace, or a library it opens),
 * copies identity and evidence out into caller-owned storage, and guards the lifecycle with
 * process-wide state: an operation called in the wrong state fails with CSNS_E_STATE before the
 * provider is touched. Provider tables never leave the shim.
 *
 * Return values: negative = a shim error (CSNS_E_*); zero or positive = the provider's
 * ncclResult_t, passed through unchanged (0 = success).
 */
#ifndef COLDSNAP_NCCL_SHIM_H
#define COLDSNAP_NCCL_SHIM_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define CSNS_API __attribute__((visibility("default")))
#define CSNS_VERSION 1u

#define CSNS_OK 0
#define CSNS_E_ARGUMENT (-1)     /* NULL where a pointer is required, or an unknown selector */
#define CSNS_E_LOAD (-2)         /* the library could not be opened (see csns_last_error) */
#define CSNS_E_MISSING (-3)      /* the export is absent */
#define CSNS_E_STATE (-4)        /* wrong lifecycle state: nothing was called */
#define CSNS_E_NULL_TABLE (-5)   /* the query succeeded but returned no table */
#define CSNS_E_TRUNCATED (-6)    /* the table's struct_size is smaller than this shim needs */
#define CSNS_E_ABI (-7)          /* the table's abi_major is not 1 */
#define CSNS_E_TOO_LARGE (-8)    /* evidence longer than CSNS_EVIDENCE_MAX */
#define CSNS_E_NO_SLOT (-9)      /* the table's function slot is NULL */
#define CSNS_E_NO_EVIDENCE (-10) /* the provider returned no evidence string */
#define CSNS_E_BUFFER (-11)      /* caller buffer too small: *length says how much is needed */

#define CSNS_EVIDENCE_MAX (64u * 1024u)
#define CSNS_PROVIDER_ID_MAX 128u

/* Tables, for csns_layout(). */
#define CSNS_TABLE_PROVIDER 0u
#define CSNS_TABLE_IN_PLACE 1u
#define CSNS_TABLE_RESOURCES 2u
#define CSNS_LAYOUT_SIZE 0xFFFFFFFFu

/* Lifecycle operations. */
#define CSNS_IN_PLACE_SUSPEND 0u
#define CSNS_IN_PLACE_DETACH 1u
#define CSNS_IN_PLACE_REATTACH 2u
#define CSNS_IN_PLACE_RESUME 3u
#define CSNS_RECREATE_PREPARE 0u
#define CSNS_RECREATE_RESTORE 1u
#define CSNS_RECREATE_NETWORK_RESET 2u
#define CSNS_RECREATE_NETWORK_INIT 3u

/* Process-wide states (csns_state). */
#define CSNS_STATE_ACTIVE 0u
#define CSNS_STATE_SUSPENDED 1u
#define CSNS_STATE_TRANSPORT_DETACHED 2u
#define CSNS_STATE_TRANSPORT_REATTACHED 3u
#define CSNS_STATE_FAILED 4u /* an in-place step failed mid-way: terminal for this activation */
#define CSNS_RECREATE_IDLE 0u
#define CSNS_RECREATE_PREPARED 1u
#define CSNS_RECREATE_RESTORED 2u /* terminal after the first restore attempt, even a failed one */

/* Presence bits of struct csns_identity.exports. */
#define CSNS_EXPORT_PROVIDER_QUERY (1u << 0)
#define CSNS_EXPORT_IN_PLACE_QUERY (1u << 1)
#define CSNS_EXPORT_RESOURCES_QUERY (1u << 2)
#define CSNS_EXPORT_CHECKPOINT_GET_VERSION (1u << 3)
#define CSNS_EXPORT_NCCL_GET_VERSION (1u << 4)
#define CSNS_EXPORT_DLSYM_BRIDGE_ABI (1u << 5)

typedef struct csns_handle csns_handle;

/* Identity copied out of the provider_v1 table and the version exports. */
struct csns_identity {
    uint32_t size;    /* set by the caller to sizeof(struct csns_identity) */
    uint32_t exports; /* CSNS_EXPORT_* bits */
    int32_t query_result;
    uint32_t struct_size;
    uint32_t abi_major;
    uint32_t abi_minor;
    uint32_t provider_revision;
    int32_t compiled_nccl_version;
    int32_t loaded_nccl_version;
    uint32_t checkpoint_abi_version;
    uint64_t capability_mask;
    uint32_t slots; /* bit i: slot i of prepare, restore, network_reset, network_init, ib_status, comm_get_real */
    int32_t provider_id_state; /* 0 NULL, 1 copied, 2 longer than CSNS_PROVIDER_ID_MAX - 1 */
    char provider_id[CSNS_PROVIDER_ID_MAX];
    int32_t checkpoint_version_result;
    int32_t checkpoint_version;
    int32_t checkpoint_nccl_version;
    int32_t nccl_get_version_result;
    int32_t nccl_version;
    uint32_t dlsym_bridge_abi;
};

/* What an optional query returned. */
struct csns_table_info {
    uint32_t size; /* set by the caller */
    int32_t query_result;
    uint32_t struct_size;
    uint32_t abi_major;
    uint32_t abi_minor;
    uint32_t slots; /* bit i: slot i is non-NULL, in table order */
};

/* Open `library` (RTLD_NOW|RTLD_GLOBAL), or the process-global namespace when NULL. */
CSNS_API int32_t csns_open(const char *library, csns_handle **out);
CSNS_API void csns_close(csns_handle *handle);
/* The last load error of this thread, copied into `buffer` (always NUL-terminated). */
CSNS_API void csns_last_error(char *buffer, size_t capacity);
CSNS_API uint32_t csns_version(void);
/* sizeof (field = CSNS_LAYOUT_SIZE) or offsetof field `field` of a table, as compiled here. */
CSNS_API uint32_t csns_layout(uint32_t table, uint32_t field);

/* Query provider_v1 and the version exports; CSNS_OK even when the query itself failed. */
CSNS_API int32_t csns_identity(csns_handle *handle, struct csns_identity *out);
/* Query the optional tables: CSNS_E_MISSING when the export is absent, else CSNS_OK with info. */
CSNS_API int32_t csns_in_place_info(csns_handle *handle, struct csns_table_info *out);
CSNS_API int32_t csns_resources_info(csns_handle *handle, struct csns_table_info *out);

/* Lifecycle operations, guarded by the process-wide state. */
CSNS_API int32_t csns_in_place_call(csns_handle *handle, uint32_t operation);
CSNS_API int32_t csns_recreate_call(csns_handle *handle, uint32_t operation);
CSNS_API void csns_state(uint32_t *in_place_state, uint32_t *recreate_state);
/* Evidence JSON copied into `buffer`; *length is set to its length (without the NUL). */
CSNS_API int32_t csns_in_place_evidence(csns_handle *handle, char *buffer, size_t capacity, size_t *length);
/* Run inspect(mode); its ncclResult_t goes to *inspect_result, the evidence into `buffer`. */
CSNS_API int32_t csns_resources_inspect(csns_handle *handle, uint32_t mode, int32_t *inspect_result, char *buffer,
                                        size_t capacity, size_t *length);
/* IB status through the provider's optional slot. */
CSNS_API int32_t csns_ib_status(csns_handle *handle, int32_t status[4]);

#ifdef __cplusplus
}
#endif

#endif /* COLDSNAP_NCCL_SHIM_H */
