/*
 * coldsnap_nccl_shim.h - a small, stable C API over the ColdSnap NCCL provider ABIs.
 *
 * The shim finds the provider's query exports (process-global namespace, or a library it opens)
 * and copies identity and table descriptions out into caller-owned storage, for admission.
 * Provider tables never leave the shim. (The in-place and recreate lifecycle calls and the
 * evidence readers were removed with their Python binding: no process of this project drives an
 * engine's communicator lifecycle; see git history at 445646e when an engine integration needs them.)
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


#ifdef __cplusplus
}
#endif

#endif /* COLDSNAP_NCCL_SHIM_H */
