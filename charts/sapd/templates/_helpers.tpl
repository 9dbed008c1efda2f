{{/* Names: "<release>-<component>" within `max` characters (63, a DNS label, unless given). A release
     name too long for that is cut and made unique again with 5 hex digits of its hash, so two long
     release names sharing a prefix never collide; the component part is never cut. */}}
{{- define "sapd.name" -}}
{{- $max := int (.max | default 63) -}}
{{- $rel := .root.Release.Name -}}
{{- if gt (add (len $rel) (len .component) 1) $max -}}
{{- $room := int (sub $max (add (len .component) 7)) -}}
{{- $rel = printf "%s-%s" ($rel | trunc $room | trimSuffix "-") (sha256sum .root.Release.Name | trunc 5) -}}
{{- end -}}
{{- printf "%s-%s" $rel .component -}}
{{- end -}}

{{/* The release name must be a DNS-1035 label: the chart names Services (`<release>-train`,
     `<release>-retriever`) and Jobs after it. Helm itself accepts dots ("sapd.alfworld"); the API server would
     refuse the Service later, so refuse the name here, before anything is created. */}}
{{- define "sapd.validateRelease" -}}
{{- if not (regexMatch "^[a-z]([-a-z0-9]*[a-z0-9])?$" .Release.Name) -}}
{{- fail (printf "release name %q: the chart names Services after it, which must be DNS-1035 labels (lowercase letters, digits and '-', starting with a letter): choose e.g. %q" .Release.Name (.Release.Name | lower | replace "." "-" | replace "_" "-")) -}}
{{- end -}}
{{- end -}}

{{- define "sapd.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels of every object (Helm's recommended set). */}}
{{- define "sapd.labels" -}}
app.kubernetes.io/name: sapd
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/component: {{ .component }}
app.kubernetes.io/part-of: sapd
helm.sh/chart: {{ include "sapd.chart" .root }}
{{- end -}}

{{- define "sapd.selectorLabels" -}}
app.kubernetes.io/name: sapd
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Labels of a Job (or JobSet, or a CronJob's jobTemplate): the common ones, the round, Kueue's. */}}
{{- define "sapd.jobLabels" -}}
{{ include "sapd.labels" . }}
{{- if .round }}
sapd.io/round: {{ .round | quote }}
{{- end }}
{{- with .root.Values.kueue.queueName }}
kueue.x-k8s.io/queue-name: {{ . }}
{{- end }}
{{- with .root.Values.kueue.priorityClass }}
kueue.x-k8s.io/priority-class: {{ . }}
{{- end }}
{{- end -}}

{{/* Pod template metadata: selector labels, part-of/version, the round, the job's podLabels and
     podAnnotations (merged over jobDefaults'). */}}
{{- define "sapd.podMeta" -}}
{{- $s := include "sapd.settings" . | fromYaml -}}
labels:
  {{- include "sapd.selectorLabels" . | nindent 2 }}
  app.kubernetes.io/part-of: sapd
  app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
  {{- if .round }}
  sapd.io/round: {{ .round | quote }}
  {{- end }}
  {{- with $s.podLabels }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- with $s.podAnnotations }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* One job's pod settings: jobDefaults merged with the job block (lists concatenated, maps merged,
     the job's non-empty scalars winning). Returned as YAML, for `fromYaml`. */}}
{{- define "sapd.settings" -}}
{{- $d := .root.Values.jobDefaults -}}
{{- $j := .job | default dict -}}
{{- $out := dict -}}
{{- range $k := list "extraEnv" "envFrom" "extraVolumes" "extraVolumeMounts" "tolerations" "topologySpreadConstraints" -}}
{{- $_ := set $out $k (concat (get $d $k | default list) (get $j $k | default list)) -}}
{{- end -}}
{{- range $k := list "podAnnotations" "podLabels" "jobAnnotations" "nodeSelector" "affinity" -}}
{{- $_ := set $out $k (mergeOverwrite (deepCopy (get $d $k | default dict)) (deepCopy (get $j $k | default dict))) -}}
{{- end -}}
{{- range $k := list "priorityClassName" "serviceAccountName" "runtimeClassName" "schedulerName" "terminationGracePeriodSeconds" -}}
{{- $v := get $j $k -}}
{{- if or (kindIs "invalid" $v) (eq (toString $v) "") -}}{{- $v = get $d $k -}}{{- end -}}
{{- $_ := set $out $k $v -}}
{{- end -}}
{{- toYaml $out -}}
{{- end -}}

{{/* The image of a job: its block's `image` keys over the top-level ones; the tag defaults to
     <appVersion>-<flavor>; a digest wins over the tag: the job block's own `image.digest`, else the
     top-level `image.digests[<flavor>]` (each flavor is its own image). `.flavor` (optional) is the
     job's default flavor. */}}
{{- define "sapd.imageRef" -}}
{{- $img := mergeOverwrite (deepCopy .root.Values.image) (deepCopy (.job.image | default dict)) -}}
{{- $flavor := $img.flavor -}}
{{- if and .flavor (not (.job.image | default dict).flavor) -}}{{- $flavor = .flavor -}}{{- end -}}
{{- $digest := (.job.image | default dict).digest | default (get (.root.Values.image.digests | default dict) $flavor) -}}
{{- if $digest -}}
{{- printf "%s@%s" $img.repository $digest -}}
{{- else -}}
{{- printf "%s:%s" $img.repository ($img.tag | default (printf "%s-%s" .root.Chart.AppVersion $flavor)) -}}
{{- end -}}
{{- end -}}

{{- define "sapd.image" -}}
{{- $img := omit (mergeOverwrite (deepCopy .root.Values.image) (deepCopy (.job.image | default dict))) "digests" -}}
image: {{ include "sapd.imageRef" . | quote }}
imagePullPolicy: {{ $img.pullPolicy }}
{{- end -}}

{{/* The resolved overlay of one job: the shared `config`, the job's own `config` over it, and the
     values that the chart owns (run_root, workers; `.extra` for keys a job block sets). */}}
{{- define "sapd.jobConfig" -}}
{{- $cfg := mergeOverwrite (deepCopy .root.Values.config) (deepCopy (.job.config | default dict)) (deepCopy (.extra | default dict)) -}}
{{- $_ := set $cfg "run_root" .root.Values.runRoot -}}
{{- $_ := set $cfg "workers" (int .root.Values.teacherScores.parallelism) -}}
{{- include "sapd.yaml" $cfg -}}
{{- end -}}

{{/* The benchmark a job's config names (its own config over the shared one). */}}
{{- define "sapd.benchmark" -}}
{{- $cfg := mergeOverwrite (deepCopy .root.Values.config) (deepCopy (.job.config | default dict)) -}}
{{- (($cfg.data | default dict).benchmark | default "alfworld") -}}
{{- end -}}

{{/* toYaml, except that a decimal number `--set` passed as a string (Helm's --set types only integers,
     so `--set config.train.lr=1e-6` is the string "1e-6", which toYaml quotes) is written unquoted: the
     run config holds numbers, and sapd reads YAML 1.2 (sapd/yamlio.py), where 1e-6, .5 and 1e-06 (Go's
     way of writing small floats) are all floats. Only values with a dot or an exponent are unquoted. */}}
{{- define "sapd.yaml" -}}
{{- $y := toYaml . -}}
{{- $y = regexReplaceAll "(?m)^(\\s*(?:- |[^\\s:#'\"][^:#'\"]*: +))[\"']([-+]?(?:\\.[0-9]+|[0-9]+\\.[0-9]*|[0-9]+(?:\\.[0-9]*)?[eE][-+]?[0-9]+)(?:[eE][-+]?[0-9]+)?)[\"']$" $y "${1}${2}" -}}
{{- $y -}}
{{- end -}}

{{/* Environment every job gets: S3 endpoint and credentials, the Pushgateway, the lease owner (the
     release), caches on /scratch (or the shared model cache), then the job's extraEnv. `.index` true: SAPD_METRICS_INSTANCE is the pod's
     completion index (a Pushgateway grouping key per worker). */}}
{{- define "sapd.env" -}}
{{- $s := include "sapd.settings" . | fromYaml -}}
- name: SAPD_S3_ENDPOINT_URL
  value: {{ .root.Values.s3.endpoint | quote }}
- name: AWS_DEFAULT_REGION
  value: {{ .root.Values.s3.region | quote }}
{{- if not .root.Values.s3.useServiceAccount }}
- name: AWS_ACCESS_KEY_ID
  valueFrom:
    secretKeyRef:
      name: {{ .root.Values.s3.secretName }}
      key: {{ .root.Values.s3.accessKeyIdKey }}
- name: AWS_SECRET_ACCESS_KEY
  valueFrom:
    secretKeyRef:
      name: {{ .root.Values.s3.secretName }}
      key: {{ .root.Values.s3.secretAccessKeyKey }}
{{- end }}
- name: SAPD_PUSHGATEWAY_URL
  value: {{ .root.Values.pushgateway.url | quote }}
- name: SAPD_JOB
  value: {{ .component }}
# the training ranks (train pods × processes per pod): what the checks size ZeRO's shards by and divide a
# minibatch's micro-batches over, in the driver and the preflight pod too
- name: SAPD_TRAIN_PROCESSES
  value: {{ mul (int .root.Values.train.parallelism) (int .root.Values.train.procsPerPod) | quote }}
- name: SAPD_RELEASE
  value: {{ .root.Release.Name | quote }}
{{- /* every pod of the release claims the run root's lease as the release: the driver, its successor after a
     restart or an upgrade, the gates and the stage Jobs share it; another release on the root is refused */}}
- name: SAPD_LEASE_OWNER
  value: {{ printf "release %s in namespace %s" .root.Release.Name .root.Release.Namespace | quote }}
- name: SAPD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
{{- if .index }}
- name: SAPD_METRICS_INSTANCE
  valueFrom:
    fieldRef:
      fieldPath: metadata.annotations['batch.kubernetes.io/job-completion-index']
{{- end }}
- name: HOME
  value: /scratch/home
{{- if .root.Values.modelCache.type }}
- name: SAPD_CACHE_DIR
  value: {{ printf "%s/sapd" .root.Values.modelCache.mountPath | quote }}
- name: HF_HOME
  value: {{ printf "%s/hf" .root.Values.modelCache.mountPath | quote }}
{{- else }}
- name: HF_HOME
  value: /scratch/hf
{{- end }}
- name: SAPD_TEXTWORLD_CACHE
  value: {{ ternary (printf "%s/textworld" .root.Values.modelCache.mountPath) "/scratch/textworld" (ne .root.Values.modelCache.type "") | quote }}
- name: PYTHONUNBUFFERED
  value: "1"
{{- if and .webshop .root.Values.evaluate.webshop.url }}
- name: SAPD_WEBSHOP_URL
  value: {{ .root.Values.evaluate.webshop.url | quote }}
{{- end }}
{{- with .env }}
{{ toYaml . }}
{{- end }}
{{- /* values as strings: `--set extraEnv[0].value=1` gives a number, which a pod spec refuses */}}
{{- $extra := list }}
{{- range $s.extraEnv }}
{{- $e := deepCopy . }}
{{- if hasKey $e "value" }}{{ $_ := set $e "value" (toString $e.value) }}{{ end }}
{{- $extra = append $extra $e }}
{{- end }}
{{- with $extra }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Batch fields every Job spec carries: retries (or per-index retries), deadline, TTL, and a
     podFailurePolicy that fails the Job at once on exit code 2 (a config or input error, not worth a
     retry on a GPU node) and counts everything else (75 is sapd's "storage unreachable, retry").
     `.failJobCodes` overrides [2]; `.perIndex` uses backoffLimitPerIndex instead of backoffLimit.
     A preemption, eviction or drain (the pod's DisruptionTarget condition) is not the pod's fault: it is
     ignored (the pod is replaced, uncounted), except with `.gang` (a torchrun group, which cannot take one
     replaced rank): then it fails the Job through rule 0, and the driver (or JobSet) restarts the whole
     group without counting it. Rule 1 is always the exit-code rule: JobSet's rules tell them apart by index.
     `status: "True"` is written out: the API server defaults it, but the 1.31–1.34 schemas require it. */}}
{{- define "sapd.batchFields" -}}
{{- if .perIndex }}
backoffLimitPerIndex: {{ int .job.backoffLimitPerIndex }}
maxFailedIndexes: {{ int .job.maxFailedIndexes }}
{{- else }}
backoffLimit: {{ int .job.backoffLimit }}
{{- end }}
activeDeadlineSeconds: {{ int .job.activeDeadlineSeconds }}
ttlSecondsAfterFinished: {{ int .job.ttlSecondsAfterFinished }}
podReplacementPolicy: Failed
podFailurePolicy:
  rules:
    - action: {{ ternary "FailJob" "Ignore" (eq (toString .gang) "true") }}
      onPodConditions:
        - type: DisruptionTarget
          status: "True"
    - action: FailJob
      onExitCodes:
        containerName: {{ .container | default .component }}
        operator: In
        values: {{ toJson (.failJobCodes | default (list 2)) }}
{{- end -}}

{{/* Pod-spec fields shared by every job: identity, scheduling, security, volumes. Context keys: root,
     component, job; `shm` (size), `scratch` (size), `extraVolumes` (chart-internal volumes),
     `serviceAccount` (the driver's own), `automount` (mount the token). */}}
{{- define "sapd.podCommon" -}}
{{- $s := include "sapd.settings" . | fromYaml -}}
restartPolicy: Never
{{- with (.serviceAccount | default $s.serviceAccountName) }}
serviceAccountName: {{ . }}
{{- end }}
automountServiceAccountToken: {{ .automount | default false }}
{{- with $s.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with $s.runtimeClassName }}
runtimeClassName: {{ . }}
{{- end }}
{{- with $s.schedulerName }}
schedulerName: {{ . }}
{{- end }}
{{- if not (kindIs "invalid" $s.terminationGracePeriodSeconds) }}
terminationGracePeriodSeconds: {{ int $s.terminationGracePeriodSeconds }}
{{- end }}
securityContext:
  {{- toYaml .root.Values.securityContext.pod | nindent 2 }}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $s.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $s.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $s.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $s.topologySpreadConstraints }}
topologySpreadConstraints:
  {{- toYaml . | nindent 2 }}
{{- end }}
volumes:
  - name: config
    configMap:
      name: {{ include "sapd.name" (dict "root" .root "component" "config") }}
      items:
        - key: {{ .configKey | default .component }}.yaml
          path: config.yaml
  - name: scratch
    emptyDir:
      sizeLimit: {{ .scratch | default .job.scratchSize | default .root.Values.scratchSize }}
  - name: tmp
    emptyDir:
      sizeLimit: 10Gi
  {{- with .shm | default .job.shmSize }}
  - name: dshm
    emptyDir:
      medium: Memory
      sizeLimit: {{ . }}
  {{- end }}
  {{- with .root.Values.modelCache }}
  {{- if eq .type "hostPath" }}
  # an existing folder (the kubelet would create a missing one root-owned 0755, which uid 1000 cannot write)
  - name: model-cache
    hostPath:
      path: {{ .hostPath }}
      type: Directory
  {{- else if eq .type "pvc" }}
  - name: model-cache
    persistentVolumeClaim:
      claimName: {{ required "modelCache.claimName is required with modelCache.type pvc" .claimName }}
  {{- end }}
  {{- end }}
  {{- with .extraVolumes }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
  {{- with $s.extraVolumes }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- end -}}

{{/* The volume mounts every container of a job gets. */}}
{{- define "sapd.mounts" -}}
{{- $s := include "sapd.settings" . | fromYaml -}}
- name: config
  mountPath: /etc/sapd
  readOnly: true
- name: scratch
  mountPath: /scratch
- name: tmp
  mountPath: /tmp
{{- if .shm | default .job.shmSize }}
- name: dshm
  mountPath: /dev/shm
{{- end }}
{{- if .root.Values.modelCache.type }}
- name: model-cache
  mountPath: {{ .root.Values.modelCache.mountPath }}
{{- end }}
{{- with .extraMounts }}
{{ toYaml . }}
{{- end }}
{{- with $s.extraVolumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Container fields shared by every job's main container. */}}
{{- define "sapd.containerCommon" -}}
{{- $s := include "sapd.settings" . | fromYaml -}}
{{ include "sapd.image" . }}
securityContext:
  {{- toYaml .root.Values.securityContext.container | nindent 2 }}
resources:
  {{- toYaml (.resources | default .job.resources) | nindent 2 }}
volumeMounts:
  {{- include "sapd.mounts" . | nindent 2 }}
{{- with $s.envFrom }}
envFrom:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}
