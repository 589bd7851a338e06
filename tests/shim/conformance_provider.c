/* conformance_provider.c - test providers for the ColdSnap NCCL provider ABIs, built by the tests.
 *
 * Default: a 2.31-like provider with the in-place export. Variants (-D):
 *   NO_IN_PLACE            2.30-like: no coldsnapNcclInPlaceQuery export
 *   TRUNCATED              provider table struct_size 64
 *   ABI_MAJOR=n            provider table abi_major n
 *   LOADED_VERSION=n       ncclGetVersion reports n (compiled stays COMPILED_VERSION)
 *   HUGE_EVIDENCE          in-place evidence over 64 KiB
 *   BAD_EVIDENCE           in-place evidence that is not JSON
 *   WITH_RESOURCES         export coldsnapNcclResourcesQuery
 *   FORWARD_NCCL           no ncclGetVersion of its own: the loaded version comes from the real NCCL
 * conformance_calls() counts every provider operation actually invoked.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "coldsnap_nccl_provider.h"

#ifndef COMPILED_VERSION
#ifdef NO_IN_PLACE
#define COMPILED_VERSION 23007
#else
#define COMPILED_VERSION 23102
#endif
#endif
#ifndef LOADED_VERSION
#define LOADED_VERSION COMPILED_VERSION
#endif
#ifndef ABI_MAJOR
#define ABI_MAJOR 1u
#endif
#ifdef NO_IN_PLACE
#define PROVIDER_ID "nccl-2.30.7-1+coldsnap.1"
#define REVISION 1u
#define MASK UINT64_C(0x1FF)
#else
#ifndef PROVIDER_ID
#define PROVIDER_ID "nccl-2.31.2-1+coldsnap.12"
#endif
#ifndef REVISION
#define REVISION 12u
#endif
#define MASK UINT64_C(0x3BFF)
#endif

static int calls;
int conformance_calls(void) { return calls; }

static int32_t op_prepare(void) { return ++calls, 0; }
static int32_t op_restore(void) { return ++calls, 0; }
static int32_t op_network_reset(void) { return ++calls, 0; }
static int32_t op_network_init(void) { return ++calls, 0; }
static int32_t op_ib_status(int32_t *n, int32_t *d, int32_t *p, int32_t *m) {
    ++calls;
    if (!n || !d || !p || !m) return COLDSNAP_NCCL_INVALID_ARGUMENT;
    *n = 0, *d = 1, *p = 0, *m = 0;
    return 0;
}

#ifndef FORWARD_NCCL
int32_t ncclGetVersion(int *version) {
    if (!version) return COLDSNAP_NCCL_INVALID_ARGUMENT;
    *version = LOADED_VERSION;
    return 0;
}
#endif

static int loaded_version(void) {
    int32_t (*real)(int *) = NULL;
    *(void **)&real = dlsym(RTLD_DEFAULT, "ncclGetVersion");
    int v = -1;
    if (real == NULL || real(&v) != 0) return -1;
    return v;
}

int32_t ncclCheckpointGetVersion(int *checkpoint, int *nccl) {
    if (!checkpoint || !nccl) return COLDSNAP_NCCL_INVALID_ARGUMENT;
    *checkpoint = COLDSNAP_NCCL_CHECKPOINT_ABI;
    *nccl = COMPILED_VERSION;
    return 0;
}

unsigned int coldsnapNcclDlsymBridgeAbi(void) { return COLDSNAP_NCCL_DLSYM_BRIDGE_ABI; }

static struct coldsnap_nccl_provider_v1 provider = {
#ifdef TRUNCATED
    64,
#else
    sizeof(struct coldsnap_nccl_provider_v1),
#endif
    ABI_MAJOR, 0, REVISION, COMPILED_VERSION, 0, COLDSNAP_NCCL_CHECKPOINT_ABI, 0, MASK, PROVIDER_ID,
    op_prepare, op_restore, op_network_reset, op_network_init, op_ib_status, NULL};

int32_t coldsnapNcclProviderQuery(uint32_t major, const struct coldsnap_nccl_provider_v1 **out) {
    if (out == NULL) return COLDSNAP_NCCL_INVALID_ARGUMENT;
    *out = NULL;
    if (major != 1) return COLDSNAP_NCCL_INVALID_ARGUMENT;
    provider.loaded_nccl_version = loaded_version();
    *out = &provider;
    return 0;
}

#ifndef NO_IN_PLACE
static const char *state = "active";
static unsigned long long generation;
static char evidence[1024];

static int env_ok(void) {
    const char *mode = getenv("COLDSNAP_NCCL_IN_PLACE_MODE");
    const char *ib_disable = getenv("NCCL_IB_DISABLE"), *ib_release = getenv("NCCL_IB_RELEASE_ON_FINALIZE");
    int transport = (ib_disable && strcmp(ib_disable, "1") == 0) || (ib_release && strcmp(ib_release, "1") == 0);
    return mode && strcmp(mode, "net-reconnect-v1") == 0 && transport;
}

static void rebuild(void) {
    snprintf(evidence, sizeof evidence,
             "{\"format\":1,\"kind\":\"coldsnap-nccl-in-place-evidence\",\"mode\":\"net-reconnect-v1\","
             "\"portable\":false,\"transport_epoch_portable\":true,\"network_identity_portable\":true,"
             "\"bootstrap_available\":false,\"proxy_control_reconstructed\":true,\"backend\":\"Socket\","
             "\"qualified\":false,\"state\":\"%s\",\"generation\":%llu,\"communicators\":2,"
             "\"persistent_graph_references\":1,\"receive_endpoints\":2,\"send_endpoints\":2,"
             "\"transport_ownership\":\"coldsnap\",\"limitation\":\"conformance provider\"}",
             state, generation);
}

static int32_t step(const char *from, const char *to) {
    ++calls;
    if (!env_ok() || strcmp(state, from) != 0) return COLDSNAP_NCCL_INVALID_USAGE;
    state = to;
    rebuild();
    return 0;
}
static int32_t suspend(void) {
    int32_t rc = step("active", "suspended");
    if (rc == 0) ++generation, rebuild();
    return rc;
}
static int32_t detach(void) { return step("suspended", "transport-detached"); }
static int32_t reattach(void) { return step("transport-detached", "transport-reattached"); }
static int32_t resume(void) { return step("transport-reattached", "active"); }
static const char *evidence_json(void) {
#if defined(HUGE_EVIDENCE)
    static char *huge;
    if (huge == NULL) {
        huge = malloc(70000);
        memset(huge, ' ', 69999);
        huge[0] = '{', huge[69998] = '}', huge[69999] = '\0';
    }
    return huge;
#elif defined(BAD_EVIDENCE)
    return "{not json";
#else
    if (!evidence[0]) rebuild();
    return evidence;
#endif
}

static const struct coldsnap_nccl_in_place_v1 in_place = {
    sizeof(struct coldsnap_nccl_in_place_v1), 1, 0, 0, suspend, detach, reattach, resume, evidence_json};

int32_t coldsnapNcclInPlaceQuery(uint32_t major, const struct coldsnap_nccl_in_place_v1 **out) {
    if (out == NULL) return COLDSNAP_NCCL_INVALID_ARGUMENT;
    *out = NULL;
    if (major != 1) return COLDSNAP_NCCL_INVALID_ARGUMENT;
    if (!env_ok()) return COLDSNAP_NCCL_INVALID_USAGE;
    *out = &in_place;
    return 0;
}
#endif

#ifdef WITH_RESOURCES
static __thread char inventory[1024];
static int32_t inspect(uint32_t mode) {
    ++calls;
    if (mode > 1) return inventory[0] = '\0', COLDSNAP_NCCL_INVALID_ARGUMENT;
    snprintf(inventory, sizeof inventory,
             "{\"format\":1,\"kind\":\"coldsnap-nccl-resource-inventory\",\"mode\":\"%s\",\"complete\":true,"
             "\"admitted\":true,\"communicators\":[{\"comm_hash\":\"1f\",\"rank\":0,\"blockers\":[]}]}",
             mode ? "in-place" : "recreate");
    return 0;
}
static const char *inventory_json(void) { return inventory; }
static const struct coldsnap_nccl_resources_v1 resources = {32, 1, 0, 0, inspect, inventory_json};

int32_t coldsnapNcclResourcesQuery(uint32_t major, const struct coldsnap_nccl_resources_v1 **out) {
    if (out == NULL) return COLDSNAP_NCCL_INVALID_ARGUMENT;
    *out = NULL;
    if (major != 1) return COLDSNAP_NCCL_INVALID_ARGUMENT;
    const struct coldsnap_nccl_provider_v1 *id = NULL;
    int32_t rc = coldsnapNcclProviderQuery(1, &id);
    if (rc != 0) return rc;
    *out = &resources;
    return 0;
}
#endif
