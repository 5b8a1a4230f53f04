# modeguard: a CSI driver whose access modes hold.
SHELL := /bin/bash
GO ?= go
VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
LDFLAGS := -X main.version=$(VERSION)
GOTEST_FLAGS ?= -race -count=1

.PHONY: tools-dir all build image bench cluster-up cluster-down cluster-up-vm cluster-down-vm test-e2e-vm conformance conformance-vm demo helm-lint test test-all test-static test-csi-addons test-e2e-build test-e2e-images test-go test-fuzz test-leftovers test-vm test-vm-nfs-quota test-e2e test-unit test-integration test-sanity fuzz vet fmt-check clean

all: build

build: ## build bin/modeguard
	CGO_ENABLED=0 $(GO) build -ldflags '$(LDFLAGS)' -o bin/modeguard ./cmd/modeguard

# The image the deploy manifests run (modeguard:dev), built from the
# Dockerfile: with docker where a daemon answers, else with buildah (chroot
# isolation: its default runtime needs cgroup v2; hack/images/base.sh makes
# the base images locally where no registry is reachable).
IMAGE ?= modeguard:dev
image:
	@if docker info >/dev/null 2>&1; then \
		docker build --build-arg VERSION=$(VERSION) -t $(IMAGE) . ; \
	elif command -v buildah >/dev/null 2>&1; then \
		BUILDAH_ISOLATION=chroot buildah bud --layers --force-rm \
			--build-arg VERSION=$(VERSION) -t $(IMAGE) . ; \
	else \
		echo "make image: needs a docker daemon or buildah (Debian package buildah)"; exit 1; \
	fi

# Kubernetes v1.34 built from source on this machine (three nodes, two
# zones), with the driver installed by the Helm chart
# (hack/local-cluster/helm-values.yaml) and a claim proving it: see
# hack/local-cluster/README.md. Cold: Kubernetes ~10 min, images ~15 min;
# cached: about a minute.
KUSTOMIZE_VERSION := v5.7.1
KUSTOMIZE := $(CURDIR)/_build/tools/kustomize
export KUSTOMIZE

$(KUSTOMIZE): | tools-dir
	GOBIN=$(CURDIR)/_build/tools $(GO) install sigs.k8s.io/kustomize/kustomize/v5@$(KUSTOMIZE_VERSION)

# Helm v3, pinned like kustomize and built from the module proxy: the chart
# (deploy/helm/modeguard) is linted and rendered against the kustomize base
# in make test (test/deploy).
HELM_VERSION := v3.22.0
HELM := $(CURDIR)/_build/tools/helm
export HELM

# The link flags of Helm's own build: its version, and the Kubernetes
# version its client libraries speak (what helm template and lint assume).
HELM_LDFLAGS := -X helm.sh/helm/v3/internal/version.version=$(HELM_VERSION) \
	-X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMinor=37 \
	-X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=37

# _build/tools is a directory of the machine's cache (hack/cache.sh), keyed
# by the tools' versions and link flags.
tools-dir:
	@bash -c 'source hack/cache.sh && cache_dir tools _build/tools $(KUSTOMIZE_VERSION) $(HELM_VERSION) "$(HELM_LDFLAGS)"'

$(HELM): | tools-dir
	GOBIN=$(CURDIR)/_build/tools $(GO) install -ldflags '$(HELM_LDFLAGS)' helm.sh/helm/v3/cmd/helm@$(HELM_VERSION)

helm-lint: $(HELM)
	$(HELM) lint --strict deploy/helm/modeguard
	$(HELM) lint --strict deploy/helm/modeguard --values hack/local-cluster/helm-values.yaml
	$(HELM) lint --strict deploy/helm/modeguard --values hack/local-cluster/vm-helm-values.yaml
	$(HELM) template modeguard deploy/helm/modeguard --namespace modeguard >/dev/null

cluster-up: build $(HELM)
	bash hack/local-cluster/build.sh
	bash hack/images/base.sh
	bash hack/images/modeguard.sh
	bash hack/images/sidecars.sh all
	bash hack/local-cluster/up.sh
	bash hack/local-cluster/deploy.sh

# The same control plane on the host with worker nodes in qemu VMs on
# Debian's kernel, whose NFS client and iSCSI initiator the host's kernel
# lacks (hack/local-cluster/vm-up.sh, docs/vm-cluster.md), and modeguard
# installed with its chart (vm-deploy.sh). It runs beside the local cluster:
# the two share no port.
cluster-up-vm: build $(HELM)
	bash hack/local-cluster/build.sh
	bash hack/images/base.sh
	bash hack/images/modeguard.sh
	bash hack/images/sidecars.sh all
	bash hack/images/csi-addons.sh all
	bash hack/local-cluster/vm-up.sh
	bash hack/local-cluster/vm-deploy.sh

cluster-down-vm:
	bash hack/local-cluster/vm-down.sh

# The stories of test/e2e that need nodes of their own kernel, on the VM
# cluster: NFS volumes mounted by pods, and block volumes the storage
# targets serve over iSCSI (the block stories of the local cluster, and
# those of nodes and targets that reboot), and a NetworkFence through
# csi-addons. The stories that reboot, restart, cordon or fence a node run
# one at a time, first; then the others two at a time (MODEGUARD_E2E_PARALLEL).
# The batch is bound by the host's two cores: three at a time took as long
# as one by one, and a pod then waited up to five minutes for its sandbox. The
# cluster goes down afterwards whatever the result. The stories alone took
# 42 minutes in the last whole run here (docs/vm-cluster.md): the timeout leaves
# room to finish and be measured rather than be cut off in the parallel batch.
E2E_VM_TESTS := ^(TestNFS(RWODeploymentOnTwoNodes|RollingUpdateHandsTheClaimOver|StatefulSetPodComesBackElsewhere|AccessModesAcrossNodes|FsGroup)|Test(RWODeploymentStaysOnOneNode|RWOPDeploymentRunsOnePod|ROXFromSnapshot|ExpansionGrowsMountedFilesystem)|TestISCSI(RawBlockOneWriterReadersElsewhere|RestoreFollowsItsSource)|Test(StorageNodeReboots|KubeletRestartReconstructsTheMounts)|TestNetworkFenceCutsANodeOff|TestActingControllerDeletedDuringStories|TestChartUpgradeMovesNFSToItsTarget)$$
test-e2e-vm: $(HELM)
	@rc=0; \
	if $(MAKE) cluster-up-vm; then \
		MODEGUARD_E2E_KUBECONFIG=$(CURDIR)/_build/cluster-vm/admin.kubeconfig \
		MODEGUARD_E2E_NODES=10.98.0.21,10.98.0.22,10.98.0.23 MODEGUARD_E2E_NFS_CLIENTS=1 MODEGUARD_E2E_ISCSI=1 \
		MODEGUARD_E2E_VM_DIR=$(CURDIR)/_build/cluster-vm/vms MODEGUARD_E2E_TIMEOUT_SCALE=3 MODEGUARD_E2E_PARALLEL=1 \
			$(GO) test $(GOTEST_FLAGS) -timeout 90m -parallel 2 -v -run '$(E2E_VM_TESTS)' ./test/e2e/ || rc=$$?; \
	else rc=1; fi; \
	bash hack/local-cluster/vm-down.sh || rc=$${rc/#0/1}; \
	exit $$rc

# Every modeguard volume deleted through Kubernetes first (so the driver
# unpublishes, detaches and deletes them), then the cluster stopped by PID.
cluster-down:
	-bash hack/local-cluster/undeploy.sh
	bash hack/local-cluster/down.sh

# The stories of deploy/examples end to end on that cluster (test/e2e), then
# CONFORMANCE_SUITES of Kubernetes' storage suites; the cluster goes down
# afterwards whatever the result. The tests run against the chart's
# installation (make cluster-up), and helm uninstall must leave nothing of
# it.
test-e2e: $(HELM)
	@rc=0; \
	if $(MAKE) cluster-up; then \
		MODEGUARD_E2E_KUBECONFIG=$(CURDIR)/_build/cluster/admin.kubeconfig \
			$(GO) test $(GOTEST_FLAGS) -timeout 30m -v ./test/e2e/ || rc=$$?; \
		KUBECONFIG=$(CURDIR)/_build/cluster/admin.kubeconfig SUITES='$(CONFORMANCE_SUITES)' \
			bash hack/conformance/run.sh || rc=$${rc/#0/1}; \
		bash hack/local-cluster/undeploy.sh || rc=$${rc/#0/1}; \
	else rc=1; fi; \
	bash hack/local-cluster/down.sh || rc=$${rc/#0/1}; \
	exit $$rc

# Network fences end to end (in make test-all): csi-addons
# v0.14.0 built from the module proxy (hack/images/csi-addons.sh), the local
# cluster (as make cluster-up) with its CRDs installed before the chart, which
# runs with csiAddons.enabled (hack/local-cluster/csi-addons-values.yaml), the
# csi-addons controller (hack/local-cluster/csi-addons-install.sh), then
# hack/local-cluster/csi-addons-fence-test.sh: a NetworkFence on one node's
# address reaches Succeeded and the driver's fence list holds it, deleting
# it does not lift it, Unfenced does. Everything is uninstalled and the
# cluster goes down afterwards whatever the result. docs/testing.md.
CSI_ADDONS_LOCAL := KUBECONFIG=$(CURDIR)/_build/cluster/admin.kubeconfig CSI_ADDONS_HOST_NETWORK=true \
	CSI_ADDONS_API_HOST=127.0.0.1 CSI_ADDONS_API_PORT=6443
test-csi-addons: build $(HELM)
	@rc=0; \
	if bash hack/local-cluster/build.sh && bash hack/images/base.sh && bash hack/images/modeguard.sh && \
		bash hack/images/sidecars.sh all && bash hack/images/csi-addons.sh all && \
		bash hack/local-cluster/up.sh && \
		$(CSI_ADDONS_LOCAL) bash hack/local-cluster/csi-addons-install.sh crds && \
		HELM_EXTRA_VALUES=hack/local-cluster/csi-addons-values.yaml bash hack/local-cluster/deploy.sh && \
		$(CSI_ADDONS_LOCAL) bash hack/local-cluster/csi-addons-install.sh; then \
		KUBECONFIG=$(CURDIR)/_build/cluster/admin.kubeconfig bash hack/local-cluster/csi-addons-fence-test.sh || rc=1; \
		$(CSI_ADDONS_LOCAL) bash hack/local-cluster/csi-addons-install.sh uninstall || rc=1; \
		bash hack/local-cluster/undeploy.sh || rc=1; \
	else rc=1; fi; \
	bash hack/local-cluster/down.sh || rc=1; \
	exit $$rc

# modeguard on kind (v0.33.0, podman), every image built here: see
# hack/kind-up.sh. make test-kind runs the block stories of test/e2e on it
# and deletes it whatever the result (make test-all runs it).
kind-up: $(HELM)
	KIND_TEST=0 bash hack/kind-up.sh

kind-down:
	bash hack/kind-down.sh

test-kind: $(HELM)
	@rc=0; bash hack/kind-up.sh || rc=1; bash hack/kind-down.sh || rc=1; exit $$rc

# Kubernetes' external storage e2e suites (e2e.test v1.34.4 from the module
# proxy; volumegroupsnapshottable with e2e.test v1.35.4, whose external
# driver names a VolumeGroupSnapshotClass) against the driver on that
# cluster, with the driver files of test/conformance; docs/conformance.md has
# the results and the reason for every skip. make test-e2e runs CONFORMANCE_SUITES of the block driver:
# CONFORMANCE_GATE in make test, every suite (CONFORMANCE_ALL) in make
# test-all. The gate keeps the suites the stories of test/e2e do not
# already cover. make conformance runs every suite of both driver files
# (cluster brought up when none answers, left up afterwards: make
# cluster-down).
CONFORMANCE_GATE := provisioning|read-write-once-pod
CONFORMANCE_ALL := provisioning|volume-modify|volumes|volumeIO|volumeMode|subPath|multiVolume|read-write-once-pod|topology|snapshottable|volume-expand|fsgroupchangepolicy|ephemeral|volumeLimits|capacity|snapshottable-stress|volume-stress|volumegroupsnapshottable
CONFORMANCE_SUITES ?= $(CONFORMANCE_GATE)
conformance: build $(HELM)
	@rc=0; \
	DRIVER=block bash hack/conformance/run.sh || rc=1; \
	DRIVER=nfs bash hack/conformance/run.sh || rc=1; \
	exit $$rc

# The same suites on the VM cluster, whose nodes have the kernel's NFS client
# and iSCSI initiator: the NFS driver file, and block over iSCSI (iscsi.yaml),
# each with the suites that exercise what differs from the local cluster's
# loop devices (docs/conformance.md, "On nodes of their own"). The test images
# go onto the node disks (vm-seed.sh SEED_EXTRA); the cluster goes down
# afterwards whatever the result.
CONFORMANCE_VM_NFS ?= provisioning|volumes|volumeIO|multiVolume|subPath|fsgroupchangepolicy|read-write-once-pod|volume-expand|volume-modify|snapshottable|ephemeral
CONFORMANCE_VM_ISCSI ?= provisioning|volumes|volumeIO|volumeMode|multiVolume|read-write-once-pod|volume-expand|topology|snapshottable
conformance-vm: build $(HELM)
	bash hack/local-cluster/build.sh
	bash hack/images/base.sh
	BUILD_ONLY=1 SUITES='provisioning' bash hack/conformance/run.sh
	@rc=0; extra=$$(IMPORT=0 bash hack/conformance/images.sh | paste -sd' '); \
	if SEED_EXTRA="$$extra" $(MAKE) cluster-up-vm; then \
		for d in nfs iscsi; do \
			suites='$(CONFORMANCE_VM_NFS)'; [ $$d = iscsi ] && suites='$(CONFORMANCE_VM_ISCSI)'; \
			KUBECONFIG=$(CURDIR)/_build/cluster-vm/admin.kubeconfig DRIVER=$$d SUITES="$$suites" \
				bash hack/conformance/run.sh || rc=1; \
		done; \
	else rc=1; fi; \
	bash hack/local-cluster/vm-down.sh || rc=1; \
	exit $$rc

# Speed and memory, measured through the driver's gRPC sockets with real
# loop devices and a real ganesha (test/bench); results in docs/benchmarks.md.
# BENCH_FLAGS=-only=lifecycle,... picks measurements (go run ./test/bench -h).
bench: build
	@command -v fio >/dev/null || { apt-get install -y -qq fio >/dev/null || { apt-get update -qq && apt-get install -y -qq fio >/dev/null; }; }
	$(GO) run ./test/bench -binary bin/modeguard $(BENCH_FLAGS)

demo: build ## a controller and three node plugins in two zones, walked through the stories
	./bin/modeguard demo

# make test is CI's gate: every access-mode rule, every backend and storage,
# both transports, the kernel NFS client, the stories on the local cluster
# and a conformance subset, well inside CI's 90 minutes (README, Tests).
# make test-all runs everything: the gate's phases with their whole suites
# (every VM test, every conformance suite) and what only it runs. Both run
# their phases one after the other whatever fails, and end with a table of
# what each took (hack/phases.sh). Tests that need root, loop devices and
# mounts skip themselves (and say so) when run unprivileged; CI runs them as
# root.
GATE_TESTS := static=test-static bg:e2e-build=test-e2e-build go=test-go bg:e2e-images=test-e2e-images \
	fuzz=test-fuzz vm-quota=test-vm wait:e2e-build wait:e2e-images e2e=test-e2e
GATE_PHASES := $(GATE_TESTS) leftovers=test-leftovers
test: tools-dir
	@bash hack/phases.sh "make test" $(GATE_PHASES)

# MODEGUARD_TESTS=all: the VM tests the gate leaves out (testenv.OnlyInTestAll).
test-all: tools-dir
	@MODEGUARD_TESTS=all CONFORMANCE_SUITES='$(CONFORMANCE_ALL)' \
		bash hack/phases.sh "make test-all" $(GATE_TESTS) vm-nfs-quota=test-vm-nfs-quota \
		kind=test-kind e2e-vm=test-e2e-vm conformance-vm=conformance-vm csi-addons=test-csi-addons leftovers=test-leftovers

test-static: fmt-check vet build $(KUSTOMIZE) helm-lint

# The compiles make test-e2e needs before it brings the cluster up:
# Kubernetes, the sidecars and e2e.test (and e2e.test v1.35.4 where
# CONFORMANCE_SUITES has volumegroupsnapshottable). On a fresh machine they take about
# 17 minutes; make test runs them in the background beside the go, fuzz
# and quota VM phases, which leave most of the CPU idle (hack/phases.sh).
# Only compiles: buildah's RUN steps work in mount namespaces of their own,
# copies of the machine's mounts that keep the loop devices of tests
# running beside them busy until they end. The base images and the driver's
# (test-e2e-images) are made beside the fuzz and quota VM phases, which
# mount nothing on this machine; make cluster-up finds them made.
test-e2e-build:
	bash hack/local-cluster/build.sh
	bash hack/images/sidecars.sh binaries
	BUILD_ONLY=1 SUITES='$(CONFORMANCE_SUITES)' bash hack/conformance/run.sh

test-e2e-images:
	bash hack/images/base.sh
	bash hack/images/modeguard.sh

# test/integration's tests mostly wait, so eleven of them run side by side
# (-parallel 4), beside the other packages; -parallel cannot be given to
# those, whose Ginkgo suites (csi-sanity) refuse it.
test-go:
	@rc=0; \
	$(GO) test $(GOTEST_FLAGS) -parallel 4 -timeout 40m ./test/integration/ & integration=$$!; \
	$(GO) test $(GOTEST_FLAGS) -timeout 40m $$($(GO) list ./... | grep -v '/test/integration$$') || rc=1; \
	wait $$integration || rc=1; \
	exit $$rc

test-fuzz:
	$(MAKE) fuzz FUZZTIME=20000x

test-leftovers:
	bash hack/check-leftovers.sh

# Tests that need a kernel or a capability this machine may lack (xfs quota
# support; CAP_SYS_RESOURCE to grow a mounted ext4), run in a small VM with
# Debian's stock kernel (qemu, software emulation).
test-vm:
	bash test/vm/projquota.sh
	VM_TEST_PKG=pkg/backend/nfs/imagestore bash test/vm/projquota.sh -test.run 'TestExt4Images|TestGrowOnline|TestGrowAndUsageMountWhatRestoreLeftOut'
	VM_TEST_PKG=pkg/backend/nfs bash test/vm/projquota.sh -test.run 'TestSnapshotOfAVolumeInUseIsOfOneInstant|TestCopyOverThePauseBudget|TestNoPausedCopyWithoutReflinksOrPause'

# The NFS restart, fence and churn tests of test/integration with the quota
# storage, in that VM (the gate runs them here with the image storage):
# about 13 minutes under emulation.
NFS_QUOTA_VM_TESTS := TestNFS(RepublishAfterARestart|FenceLiftAfterARestart|ExportsUnderRandomChurn|FenceListFollowedAfterACrash)/quota
test-vm-nfs-quota:
	VM_TEST_PKG=test/integration VM_TEST_DRIVER=1 VM_TEST_TIMEOUT=3600 bash test/vm/projquota.sh -test.run '$(NFS_QUOTA_VM_TESTS)'

test-unit:
	$(GO) test $(GOTEST_FLAGS) -short ./pkg/...

test-integration: build
	$(GO) test $(GOTEST_FLAGS) -timeout 15m ./test/integration/...

test-sanity:
	$(GO) test $(GOTEST_FLAGS) -timeout 15m ./test/sanity/...

# Every fuzz target (func FuzzXxx in a _test.go file under pkg/ or cmd/),
# each fuzzed for FUZZTIME: go test fuzzes one target of one package per
# run. make test gives each a count (20000x) rather than a time: Go 1.26's
# fuzz coordinator can fail a run that ends on a time limit with "context
# deadline exceeded" and no input, a failure that is no finding. The committed corpora (testdata/fuzz) run with plain go test as
# well; a failure here leaves its input under testdata/fuzz to keep.
FUZZTIME ?= 10s
fuzz:
	@set -e; n=0; \
	for f in $$(grep -rlE '^func Fuzz[A-Za-z0-9_]*\(' --include='*_test.go' pkg cmd | sort); do \
		for t in $$(sed -nE 's/^func (Fuzz[A-Za-z0-9_]*)\(.*/\1/p' $$f); do \
			echo "== $$t ./$$(dirname $$f)"; \
			$(GO) test -run='^$$' -fuzz="^$$t\$$" -fuzztime=$(FUZZTIME) ./$$(dirname $$f)/; \
			n=$$((n+1)); \
		done; \
	done; \
	[ $$n -gt 0 ] || { echo "make fuzz: no fuzz targets found"; exit 1; }; \
	echo "make fuzz: $$n targets, $(FUZZTIME) each, no failure"

# hack/snapshot-metadata is a module of its own (the snapshot metadata
# sidecar's pins and the backup client of test/e2e).
vet:
	$(GO) vet ./...
	cd hack/snapshot-metadata && GOFLAGS=-mod=mod $(GO) vet ./...

fmt-check:
	@out=$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go')); \
	if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi

clean:
	rm -rf bin _build
