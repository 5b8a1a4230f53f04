# Sourced by build.sh and hack/conformance/build.sh: the Kubernetes version
# both build from the module proxy, and the linker flags that stamp it into
# the binaries (what `kubectl version` and the e2e framework read).
K8S_VERSION=v1.34.4
K8S_LDFLAGS="-s -w"
for _pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  K8S_LDFLAGS+=" -X $_pkg.gitVersion=$K8S_VERSION -X $_pkg.gitMajor=1 -X $_pkg.gitMinor=34"
  K8S_LDFLAGS+=" -X $_pkg.gitTreeState=clean -X $_pkg.buildDate=1970-01-01T00:00:00Z"
done
unset _pkg
