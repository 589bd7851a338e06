/*
 * coldsnap_nccl_provider.h - the ColdSnap NCCL provider ABIs, written from the interoperability facts.
 *
 * A provider library exports:
 *   coldsnapNcclProviderQuery   (required)  identity + destroy/recreate lifecycle    (96-byte table)
 *   coldsnapNcclInPlaceQuery    (optional)  retained-graph lifecycle, kept separate  (56-byte table)
 *   coldsnapNcclResourcesQuery  (optional)  resource inventory                        (32-byte table)
 *
 * Rules: a query sets *out = NULL first and returns 4 (ncclInvalidArgument) for a NULL out or an
 * ABI-major mismatch; on success *out points at immutable, provider-owned storage. Consumers check
 * struct_size before reading any tail field and reject a different major. Tables only grow at the
 * tail (minor-compatible). A provider without the in-place export never has in-place semantics.
 * Every function returns an ncclResult_t as int32_t: 0 is success.
 */
#ifndef COLDSNAP_NCCL_PROVIDER_H
#define COLDSNAP_NCCL_PROVIDER_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define COLDSNAP_NCCL_PROVIDER_ABI_MAJOR 1u
#define COLDSNAP_NCCL_PROVIDER_ABI_MINOR 0u
#define COLDSNAP_NCCL_IN_PLACE_ABI_MAJOR 1u
#define COLDSNAP_NCCL_IN_PLACE_ABI_MINOR 0u
#define COLDSNAP_NCCL_RESOURCES_ABI_MAJOR 1u
#define COLDSNAP_NCCL_RESOURCES_ABI_MINOR 0u
#define COLDSNAP_NCCL_CHECKPOINT_ABI 100u /* NCCL_VERSION(0,1,0) */
#define COLDSNAP_NCCL_DLSYM_BRIDGE_ABI 1u

#define COLDSNAP_NCCL_CHECKPOINT_RECREATE 0u
#define COLDSNAP_NCCL_CHECKPOINT_IN_PLACE 1u

/* ncclResult_t values used by the ABI. */
#define COLDSNAP_NCCL_SUCCESS 0
#define COLDSNAP_NCCL_INTERNAL_ERROR 3
#define COLDSNAP_NCCL_INVALID_ARGUMENT 4
#define COLDSNAP_NCCL_INVALID_USAGE 5

/* Capability bits of coldsnap_nccl_provider_v1.capability_mask (stable across releases). */
#define COLDSNAP_NCCL_CAP_FULL_NETWORK_RESET (UINT64_C(1) << 0)
#define COLDSNAP_NCCL_CAP_IB_ROCE_DEVICE_RELEASE (UINT64_C(1) << 1)
#define COLDSNAP_NCCL_CAP_RAS_RESET (UINT64_C(1) << 2)
#define COLDSNAP_NCCL_CAP_SYNCHRONOUS_TERMINATION (UINT64_C(1) << 3)
#define COLDSNAP_NCCL_CAP_COORDINATOR_PROTOCOL_V1 (UINT64_C(1) << 4)
#define COLDSNAP_NCCL_CAP_PRIVATE_DLOPEN_ROUTING (UINT64_C(1) << 5)
#define COLDSNAP_NCCL_CAP_COMMUNICATOR_UNWRAP (UINT64_C(1) << 6)
#define COLDSNAP_NCCL_CAP_REGISTRATION_WINDOW_REPLAY (UINT64_C(1) << 7)
#define COLDSNAP_NCCL_CAP_SPLIT_SHRINK_GROW_REPLAY (UINT64_C(1) << 8)
#define COLDSNAP_NCCL_CAP_CUDA_GRAPH (UINT64_C(1) << 9)
#define COLDSNAP_NCCL_CAP_NCCL_DEVICE_API (UINT64_C(1) << 10)
#define COLDSNAP_NCCL_CAP_COMMUNICATOR_SUSPEND_IN_PLACE (UINT64_C(1) << 11)
#define COLDSNAP_NCCL_CAP_TRANSPORT_DETACH_IN_PLACE (UINT64_C(1) << 12)
#define COLDSNAP_NCCL_CAP_GRAPH_RESOURCE_RETENTION (UINT64_C(1) << 13)
#define COLDSNAP_NCCL_CAP_REGISTRATION_WINDOW_IN_PLACE_REPLAY (UINT64_C(1) << 14)
#define COLDSNAP_NCCL_CAP_NVLS_IN_PLACE_REPLAY (UINT64_C(1) << 15)
#define COLDSNAP_NCCL_CAP_DEVICE_API_STATE_RETENTION (UINT64_C(1) << 16)
#define COLDSNAP_NCCL_CAP_KNOWN_MASK UINT64_C(0x1FFFF)

typedef int32_t (*coldsnap_nccl_provider_operation_fn)(void);
typedef int32_t (*coldsnap_nccl_provider_ib_status_fn)(int32_t *net_refs, int32_t *devices, int32_t *pd_refs,
                                                       int32_t *mr_count);
typedef int32_t (*coldsnap_nccl_provider_comm_get_real_fn)(void *synthetic_comm, void **real_comm);
typedef const char *(*coldsnap_nccl_provider_evidence_fn)(void);
typedef int32_t (*coldsnap_nccl_resource_inspect_fn)(uint32_t checkpoint_mode);

/* Identity and the destroy/recreate lifecycle: 96 bytes on LP64. */
struct coldsnap_nccl_provider_v1 {
    uint32_t struct_size;
    uint32_t abi_major;
    uint32_t abi_minor;
    uint32_t provider_revision;
    int32_t compiled_nccl_version;
    int32_t loaded_nccl_version;
    uint32_t checkpoint_abi_version;
    uint32_t reserved0;
    uint64_t capability_mask;
    const char *provider_id;
    coldsnap_nccl_provider_operation_fn prepare;
    coldsnap_nccl_provider_operation_fn restore;
    coldsnap_nccl_provider_operation_fn network_reset;
    coldsnap_nccl_provider_operation_fn network_init;
    coldsnap_nccl_provider_ib_status_fn ib_status;         /* may be NULL */
    coldsnap_nccl_provider_comm_get_real_fn comm_get_real; /* may be NULL */
};

/* The retained-graph lifecycle: 56 bytes on LP64. States: active -> suspended ->
 * transport-detached -> transport-reattached -> active; a call in the wrong state returns 5. */
struct coldsnap_nccl_in_place_v1 {
    uint32_t struct_size;
    uint32_t abi_major;
    uint32_t abi_minor;
    uint32_t reserved0;
    coldsnap_nccl_provider_operation_fn communicator_suspend;
    coldsnap_nccl_provider_operation_fn transport_detach;
    coldsnap_nccl_provider_operation_fn transport_reattach;
    coldsnap_nccl_provider_operation_fn communicator_resume;
    coldsnap_nccl_provider_evidence_fn evidence_json;
};

/* The resource inventory: 32 bytes on LP64. */
struct coldsnap_nccl_resources_v1 {
    uint32_t struct_size;
    uint32_t abi_major;
    uint32_t abi_minor;
    uint32_t reserved0;
    coldsnap_nccl_resource_inspect_fn inspect;
    coldsnap_nccl_provider_evidence_fn evidence_json;
};

typedef int32_t (*coldsnap_nccl_provider_query_fn)(uint32_t requested_abi_major,
                                                   const struct coldsnap_nccl_provider_v1 **provider);
typedef int32_t (*coldsnap_nccl_in_place_query_fn)(uint32_t requested_abi_major,
                                                   const struct coldsnap_nccl_in_place_v1 **provider);
typedef int32_t (*coldsnap_nccl_resources_query_fn)(uint32_t requested_abi_major,
                                                    const struct coldsnap_nccl_resources_v1 **provider);

#if defined(__LP64__)
#define COLDSNAP_NCCL_ASSERT_(cond, msg) _Static_assert(cond, msg)
COLDSNAP_NCCL_ASSERT_(sizeof(struct coldsnap_nccl_provider_v1) == 96, "provider_v1 is 96 bytes");
COLDSNAP_NCCL_ASSERT_(offsetof(struct coldsnap_nccl_provider_v1, provider_revision) == 12, "provider_revision");
COLDSNAP_NCCL_ASSERT_(offsetof(struct coldsnap_nccl_provider_v1, compiled_nccl_version) == 16, "compiled");
COLDSNAP_NCCL_ASSERT_(offsetof(struct coldsnap_nccl_provider_v1, loaded_nccl_version) == 20, "loaded");
COLDSNAP_NCCL_ASSERT_(offsetof(struct coldsnap_nccl_provider_v1, checkpoint_abi_version) == 24, "checkpoint");
COLDSNAP_NCCL_ASSERT_(offsetof(struct coldsnap_nccl_provider_v1, capability_mask) == 32, "capability_mask");
COLDSNAP_NCCL_ASSERT_(offsetof(struct coldsnap_nccl_provider_v1, provider_id) == 40, "provider_id");
COLDSNAP_NCCL_ASSERT_(offsetof(struct coldsnap_nccl_provider_v1, prepare) == 48, "prepare");
COLDSNAP_NCCL_ASSERT_(offsetof(struct coldsnap_nccl_provider_v1, restore) == 56, "restore");
COLDSNAP_NCCL_ASSERT_(offsetof(struct coldsnap_nccl_provider_v1, network_reset) == 64, "network_reset");
COLDSNAP_NCCL_ASSERT_(offsetof(struct coldsnap_nccl_provider_v1, network_init) == 72, "network_init");
COLDSNAP_NCCL_ASSERT_(offsetof(struct coldsnap_nccl_provider_v1, ib_status) == 80, "ib_status");
COLDSNAP_NCCL_ASSERT_(offsetof(struct coldsnap_nccl_provider_v1, comm_get_real) == 88, "comm_get_real");
COLDSNAP_NCCL_ASSERT_(sizeof(struct coldsnap_nccl_in_place_v1) == 56, "in_place_v1 is 56 bytes");
COLDSNAP_NCCL_ASSERT_(offsetof(struct coldsnap_nccl_in_place_v1, communicator_suspend) == 16, "suspend");
COLDSNAP_NCCL_ASSERT_(offsetof(struct coldsnap_nccl_in_place_v1, transport_detach) == 24, "detach");
COLDSNAP_NCCL_ASSERT_(offsetof(struct coldsnap_nccl_in_place_v1, transport_reattach) == 32, "reattach");
COLDSNAP_NCCL_ASSERT_(offsetof(struct coldsnap_nccl_in_place_v1, communicator_resume) == 40, "resume");
COLDSNAP_NCCL_ASSERT_(offsetof(struct coldsnap_nccl_in_place_v1, evidence_json) == 48, "evidence_json");
COLDSNAP_NCCL_ASSERT_(sizeof(struct coldsnap_nccl_resources_v1) == 32, "resources_v1 is 32 bytes");
COLDSNAP_NCCL_ASSERT_(offsetof(struct coldsnap_nccl_resources_v1, inspect) == 16, "inspect");
COLDSNAP_NCCL_ASSERT_(offsetof(struct coldsnap_nccl_resources_v1, evidence_json) == 24, "resources evidence");
COLDSNAP_NCCL_ASSERT_(sizeof(int32_t) == sizeof(int), "ib_status int32_t is int");
#endif

#ifdef __cplusplus
}
#endif

#endif /* COLDSNAP_NCCL_PROVIDER_H */
